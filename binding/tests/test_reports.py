"""Reports people look at, and tracegate inside a test suite.

One real gate run (`gate m0 --only short`, the oracle's place taken by the contract with planted
defects: a 1-ULP nudge in layer.00.attn_out within the policy, layer.01.mlp_out pushed far
outside it, decode.0003.argmax flipped) gives a failing gate report, JSON and HTML, and a pair of
real traces (engine vs planted oracle) for `trace-diff` and `tracegate.compare`. One real
`gate bisect --calibrate` (the engine against the contract with layer 02's MLP planted wrong)
gives a bisect report, JSON and HTML, and one real `gate bisect --generate 3` (layer 01's cached
decode planted wrong) a decode bisection's; the same two at 30 layers (tiny-qwen3's layers
repeated), and a port's 3,002-tensor trace pair, are the pages at a real model's scale. The pages are
rendered in headless Chromium; each number the page shows is checked against the JSON of the
same run; the JSON reports are validated against docs/*.schema.json."""

from __future__ import annotations

import html.parser
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import browser
import jsonschema
import numpy as np
import pytest
import referencing
import tracegate
from referencing.jsonschema import DRAFT202012
from tracegate.testing import assert_traces_agree

ROOT = Path(__file__).resolve().parents[2]
BIN = ROOT / "target" / "release"
PLANTED = "--nudge layer.00.attn_out --push layer.01.mlp_out --flip decode.0003.argmax"


def run(args, **kw):
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, cwd=ROOT, **kw)


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """The gate run and the trace-diff run of its engine/oracle traces, each with --json and --html."""
    d = tmp_path_factory.mktemp("reports")
    oracle = f"'{sys.executable}' '{ROOT / 'gate/tests/producers/planted_trace.py'}' --base contract {PLANTED} {{verb}} {{args}}"
    g = run(
        [
            BIN / "gate",
            "--root",
            ROOT,
            "m0",
            "--model",
            ROOT / "fixtures/tiny-qwen3",
            "--only",
            "short",
            "--oracle-cmd",
            oracle,
            "--work",
            d / "work",
            "--report",
            d / "gate.json",
            "--html",
            d / "gate.html",
        ],
        env={**os.environ, "TRACEGATE_PYTHON": sys.executable},
    )
    assert g.returncode == 1, g.stdout + g.stderr
    traces = d / "work" / "m0" / "tiny-qwen3" / "short"
    # Every gate report file is an array, one report per model; --model ran one.
    (gate,) = json.loads((d / "gate.json").read_text())
    t = run(
        [
            BIN / "trace-diff",
            "--policy",
            "f32",
            "--json",
            "--html",
            d / "diff.html",
            traces / "engine.trace",
            traces / "oracle.trace",
        ]
    )
    assert t.returncode == 1, t.stderr
    return {
        "dir": d,
        "traces": traces,
        "gate": gate,
        "diff": json.loads(t.stdout),
    }


@pytest.fixture(scope="module")
def ported(tmp_path_factory):
    """A port milestone in a project of its own (`gate init` with examples/producer as the port,
    internals captured), then `gate run port --report --html` with layer 03's k_norm dropped: a
    failing agrees, localised by the bisection against the golden trace."""
    d = tmp_path_factory.mktemp("port")
    (d / "p.json").write_text(
        '{"schema": 1, "prompts": [{"id": "short", "tokens": [12, 218, 345, 152, 81]}]}'
    )
    port = f"'{BIN / 'example-producer'}' {{verb}} {{args}}"
    init = [BIN / "gate", "init", "--model", ROOT / "fixtures/tiny-qwen3", "--prompts", "p.json"]
    init += ["--candidate-cmd", port, "--capture", "internals", "--generate", "3"]
    g = subprocess.run([str(a) for a in init], capture_output=True, text=True, cwd=d)
    assert g.returncode == 0, g.stdout + g.stderr
    ms = json.loads((d / "milestones.json").read_text())
    ms["milestones"][0]["port"]["candidate"]["cmd"] = port + " --plant k-norm:3"
    (d / "milestones.json").write_text(json.dumps(ms))
    r = subprocess.run(
        [str(BIN / "gate"), "run", "port", "--report", "port.json", "--html", "port.html"],
        capture_output=True,
        text=True,
        cwd=d,
    )
    assert r.returncode == 1, r.stdout + r.stderr
    (report,) = json.loads((d / "port.json").read_text())
    return {"dir": d, "report": report}


def bisect_defective(
    d: Path, defect: str, *extra, exit_code: int, model: Path = ROOT / "fixtures/tiny-qwen3"
) -> dict:
    """`gate bisect --report --html` in `d`: the engine against the contract with one planted
    defect (gate/tests/producers/defective_contract.py, served)."""
    script = ROOT / "gate/tests/producers/defective_contract.py"
    cand = f"'{sys.executable}' '{script}' --defect {defect} {{verb|serve}} {{args}}"
    b = run(
        [
            BIN / "gate",
            "--root",
            ROOT,
            "bisect",
            "--model",
            model,
            "--prompt",
            "short",
            "--reference",
            "engine",
            "--candidate",
            "cmd",
            "--candidate-cmd",
            cand,
            *extra,
            "--work",
            d / "work",
            "--report",
            d / "bisect.json",
            "--html",
            d / "bisect.html",
        ]
    )
    assert b.returncode == exit_code, b.stdout + b.stderr
    return {"dir": d, "report": json.loads((d / "bisect.json").read_text())}


@pytest.fixture(scope="module")
def bisected_decode(tmp_path_factory):
    """One real decode bisection: the contract's cached decode rotates layer 01's rows at the
    wrong position (--defect cached-pos), 3 steps."""
    d = tmp_path_factory.mktemp("bisect-decode")
    return bisect_defective(d, "cached-pos", "--generate", "3", exit_code=6)


def thirty_layers(d: Path) -> Path:
    """tiny-qwen3 at a real model's depth: its 5 layers' weights repeated to 30 layers."""
    from safetensors.numpy import load_file, save_file

    src, out = ROOT / "fixtures/tiny-qwen3", d / "tiny-qwen3-30"
    out.mkdir()
    config = json.loads((src / "config.json").read_text())
    n = config["num_hidden_layers"]
    config["num_hidden_layers"] = config["max_window_layers"] = 30
    (out / "config.json").write_text(json.dumps(config, indent=2))
    weights = {}
    for name, value in load_file(src / "model.safetensors").items():
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
        if m is None:
            weights[name] = value
        for layer in range(int(m[1]), 30, n) if m else ():
            weights[f"model.layers.{layer}.{m[2]}"] = value
    save_file(weights, out / "model.safetensors")
    return out


@pytest.fixture(scope="module")
def bisected_at_scale(tmp_path_factory):
    """Two bisections at 30 layers: layer 17's MLP planted wrong (the prefill chart with 12
    layers downstream), and the cached decode of layer 01 over 24 steps."""
    d = tmp_path_factory.mktemp("bisect-at-scale")
    model = thirty_layers(d)
    (d / "prefill").mkdir()
    (d / "decode").mkdir()
    return {
        "prefill": bisect_defective(d / "prefill", "mlp-add@17", exit_code=1, model=model),
        "decode": bisect_defective(
            d / "decode", "cached-pos", "--generate", "24", exit_code=6, model=model
        ),
    }


@pytest.fixture(scope="module")
def bisected(tmp_path_factory):
    """One real bisection: the contract with the MLP of layer 02 planted wrong, calibrated."""
    return bisect_defective(
        tmp_path_factory.mktemp("bisect"), "mlp-add", "--calibrate", exit_code=1
    )


def validator(name: str):
    diff = json.loads((ROOT / "docs/diff-report.schema.json").read_text())
    schema = json.loads((ROOT / "docs" / name).read_text())
    registry = referencing.Registry().with_resources(
        [(diff["$id"], DRAFT202012.create_resource(diff))]
    )
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema, registry=registry)


# --- schemas ---------------------------------------------------------------------------------


def test_the_gate_report_carries_its_schema_and_validates(planted):
    rep = planted["gate"]
    assert rep["schema"] == "tracegate-gate-report/3"
    v = validator("gate-report.schema.json")
    assert list(v.iter_errors(rep)) == []
    # Negative controls: each planted defect is refused by the validator.
    plants = [
        lambda r: r.__setitem__("schema", "tracegate-gate-report/0"),
        lambda r: r["prompts"][0]["checks"][0].__setitem__("status", "OK"),
        lambda r: r["prompts"][0]["checks"][0].pop("findings"),
        lambda r: r["baselines"][0]["observed"][0].__setitem__("delta", "12%"),
        lambda r: r["prompts"][0]["oracle"]["first_violation"]["violations"][0].__setitem__(
            "bound", "max_l2"
        ),
        lambda r: r.__setitem__("note", 1),
    ]
    for i, plant in enumerate(plants):
        bad = json.loads(json.dumps(rep))
        plant(bad)
        assert list(v.iter_errors(bad)), f"plant {i} was accepted"


def test_the_diff_report_validates(planted):
    assert list(validator("diff-report.schema.json").iter_errors(planted["diff"])) == []


def test_the_bisect_report_validates(bisected):
    assert list(validator("bisect-report.schema.json").iter_errors(bisected["report"])) == []


# --- the Python API --------------------------------------------------------------------------


def test_compare_is_the_cli_report_in_process(planted):
    tr = planted["traces"]
    rep = tracegate.compare(tr / "engine.trace", tr / "oracle.trace", policy="f32")
    assert json.loads(rep.to_json()) == planted["diff"]
    assert (rep.verdict, rep.ok, rep.exit_code) == ("different", False, 1)
    assert rep.first_violation["tensor"] == "layer.01.mlp_out"
    assert rep.first_bit_difference["tensor"] == "layer.00.attn_out"
    assert [
        (f["decision"], f["row"], f["reference"], f["candidate"], f["label"])
        for f in rep.flipped_decisions
    ] == [("decode.0003.argmax", 0, [81], [80], "consequence")]
    # One row per tensor the two traces share (both hold the same names: the oracle here is the
    # planted contract, docs/gate.md).
    assert (
        len(rep.per_tensor) == len(tracegate.Trace(str(tr / "engine.trace")).names)
        and rep.decisions["differing"] == 1
    )
    # The engine and the contract are bit-identical: identical by bits, no policy needed.
    same = tracegate.compare(tr / "engine.trace", tr / "contract.trace", only="layer.**")
    assert (same.verdict, same.ok, same.filter["only"]) == ("identical", True, ["layer.**"])


def test_compare_errors_are_exceptions_naming_the_path(planted, tmp_path):
    tr = planted["traces"]
    with pytest.raises(tracegate.CompareError, match='unknown policy name "nosuch"'):
        tracegate.compare(tr / "engine.trace", tr / "oracle.trace", policy="nosuch")
    missing = tmp_path / "no-policy.json"
    with pytest.raises(tracegate.CompareError, match=re.escape(str(missing))):
        tracegate.compare(tr / "engine.trace", tr / "oracle.trace", policy=missing)
    with pytest.raises(tracegate.CompareError, match="selects no tensor or decision"):
        tracegate.compare(tr / "engine.trace", tr / "oracle.trace", only="nothing.*")
    tampered = tmp_path / "tampered.trace"
    data = bytearray((tr / "engine.trace").read_bytes())
    data[300] ^= 1  # inside embed.out's payload
    tampered.write_bytes(data)
    with pytest.raises(
        tracegate.TraceError, match=re.escape(f"reference: {tampered}: edited after capture")
    ):
        tracegate.compare(tampered, tr / "oracle.trace")
    with pytest.raises(tracegate.TraceError, match=re.escape(str(tmp_path / "absent.trace"))):
        tracegate.compare(tr / "engine.trace", tmp_path / "absent.trace")


def test_assert_traces_agree_names_the_violation_and_the_flips(planted):
    tr = planted["traces"]
    with pytest.raises(AssertionError) as failed:
        assert_traces_agree(tr / "engine.trace", tr / "oracle.trace", policy="f32")
    msg = str(failed.value)
    assert "first violation: layer.01.mlp_out (rule #3 layer.*.mlp_out)" in msg, msg
    # Bound, value and limit, as the report has them.
    v = planted["diff"]["first_violation"]["violations"][0]
    assert f"max_rel_l2: value {v['value']} > limit {v['limit']}" in msg, msg
    assert "decode.0003.argmax[0]: [81] -> [80] (consequence of layer.01.mlp_out)" in msg, msg
    assert "first bit difference: layer.00.attn_out" in msg, msg
    # Within the policy it passes (the engine against the planted oracle, before the defects).
    assert (
        assert_traces_agree(
            tr / "engine.trace", tr / "oracle.trace", policy="f32", only="layer.00.**"
        ).verdict
        == "within_policy"
    )
    assert assert_traces_agree(tr / "engine.trace", tr / "contract.trace").verdict == "identical"


# --- the pages in a browser ------------------------------------------------------------------


class Dom(html.parser.HTMLParser):
    """Every element with its attributes and its text (for the elements that hold a value)."""

    def __init__(self, text: str):
        super().__init__()
        self.elements: list = []
        self._open: list = []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        e = {"tag": tag, **{k: (v or "") for k, v in attrs}, "text": ""}
        self.elements.append(e)
        if tag not in ("meta", "br", "line", "circle", "img", "input", "link"):
            self._open.append(e)

    def handle_startendtag(self, tag, attrs):
        self.elements.append({"tag": tag, **{k: (v or "") for k, v in attrs}, "text": ""})

    def handle_endtag(self, tag):
        for i in range(len(self._open) - 1, -1, -1):
            if self._open[i]["tag"] == tag:
                del self._open[i:]
                break

    def handle_data(self, data):
        for e in self._open:
            e["text"] += data

    def find(self, **want):
        return [e for e in self.elements if all(e.get(k) == v for k, v in want.items())]

    def by_id(self, id_: str):
        found = self.find(id=id_)
        assert len(found) == 1, f"{len(found)} elements with id {id_!r}"
        return found[0]


def pointer(doc, ptr: str):
    for part in ptr.split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        doc = doc[int(part)] if isinstance(doc, list) else doc[part]
    return doc


def shown_matches(text: str, value) -> bool:
    """The words a person reads agree with the value (3 significant digits at least)."""
    text = text.strip().replace(",", "")
    if isinstance(value, str) or value is None or isinstance(value, list):
        return text in (str(value), "-", json.dumps(value)) or text == str(value)
    if isinstance(value, bool):
        return text == str(value).lower()
    scale = 100.0 if text.endswith("%") else 1.0
    shown = float(text.rstrip("%")) / scale
    return abs(shown - value) <= 5e-3 * abs(value) + (5e-4 if scale != 1.0 else 0.0)


def check_numbers(dom: Dom, report: dict) -> int:
    """Every element tied to the JSON (`data-json`) holds that JSON value (`data-v`), and the
    text it shows says the same; returns how many there were."""
    tied = [e for e in dom.elements if "data-json" in e]
    for e in tied:
        want = pointer(report, e["data-json"])
        assert json.loads(e["data-v"]) == want, (e["data-json"], e["data-v"], want)
        if e["tag"] in ("td", "span", "code") and "num" in e.get("class", "").split():
            assert shown_matches(e["text"], want), (e["data-json"], e["text"], want)
        if e.get("class") == "text":
            assert e["text"] == want, (e["data-json"], e["text"])
    return len(tied)


@pytest.fixture(scope="module")
def at_scale(tmp_path_factory):
    """A port's traces at a real model's scale, written with TraceWriter as a port writes them:
    30 layers, the prefill and 24 decode steps, 3,002 tensors; noise on every 7th, one tensor
    far outside the policy. Its trace-diff page, for the layout checks."""
    d = tmp_path_factory.mktemp("at-scale")
    rng = np.random.default_rng(0)
    names = ["embed"]
    for step in [None, *range(24)]:
        for layer in range(30):
            for point in ("hidden_in", "attn_out", "mlp_out", "hidden_out"):
                name = f"layer.{layer:02d}.{point}"
                names.append(name if step is None else f"decode.{step:04d}.{name}")
    names.append("logits")
    provenance = {"producer": "my-port", "weights_digest": "0" * 32, "prompt_tokens": [1, 2, 3]}
    with (
        tracegate.TraceWriter(d / "reference.trace", provenance) as ref,
        tracegate.TraceWriter(d / "candidate.trace", provenance) as cand,
    ):
        for i, name in enumerate(names):
            rows = 1 if name.startswith("decode.") else 3
            a = rng.standard_normal((rows, 16)).astype(np.float32)
            b = a.copy()
            if i % 7 == 0:
                b += np.float32(1e-6) * rng.standard_normal(b.shape).astype(np.float32)
            if i == 1500:
                b[0, 0] += 1.0
            ref.tensor(name, a, positions=list(range(rows)))
            cand.tensor(name, b, positions=list(range(rows)))
    page = d / "diff-at-scale.html"
    r = run(
        [BIN / "trace-diff", d / "reference.trace", d / "candidate.trace"]
        + ["--policy", "f32", "--html", page]
    )
    assert r.returncode == 1 and "3002 tensors" in r.stdout, r.stdout + r.stderr
    return page


@pytest.fixture(scope="module")
def rendered(planted, bisected, bisected_decode, at_scale, bisected_at_scale, ported):
    exe = browser.chromium()
    if exe is None:
        pytest.skip(
            "chromium is not installed (scripts/setup.sh installs Debian's chromium where it can)"
        )
    d = planted["dir"]
    py_page = d / "python.html"
    tracegate.compare(
        planted["traces"] / "engine.trace", planted["traces"] / "oracle.trace", policy="f32"
    ).to_html(py_page)
    # The negative control: a page that loads a remote image and logs a console error.
    bad = d / "bad.html"
    bad.write_text(
        '<!DOCTYPE html><html><body><img src="http://192.0.2.1/x.png">'
        '<script>console.error("planted error")</script>'
        # A layout a person could not read: two labels on one spot, a page wider than the window.
        '<svg id="planted"><text x="0" y="10">AAAA</text><text x="4" y="12">BBBB</text></svg>'
        '<div style="width:3000px">wide</div></body></html>'
    )
    b = browser.Browser(exe)
    try:
        pages = {name: b.render(d / f"{name}.html") for name in ("diff", "gate", "python", "bad")}
        pages["bisect"] = b.render(bisected["dir"] / "bisect.html")
        pages["bisect-decode"] = b.render(bisected_decode["dir"] / "bisect.html")
        pages["diff-at-scale"] = b.render(at_scale)
        pages["port"] = b.render(ported["dir"] / "port.html")
        for part in ("prefill", "decode"):
            page = bisected_at_scale[part]["dir"] / "bisect.html"
            pages[f"bisect-{part}-at-scale"] = b.render(page)
    finally:
        b.close()
    keep = os.environ.get("TRACEGATE_SCREENSHOTS")  # e.g. docs/img, to refresh README's pictures
    for name, r in pages.items():
        (d / f"{name}.png").write_bytes(r.png)
        if keep and name in ("diff", "gate", "bisect"):
            (ROOT / keep / f"{'trace-diff' if name == 'diff' else name}-report.png").write_bytes(
                r.png
            )
    return pages


def test_the_browser_sees_console_errors_and_network_requests(rendered):
    bad = rendered["bad"]
    assert bad.console_errors == ["planted error"]
    assert bad.foreign_requests() == ["http://192.0.2.1/x.png"]
    assert any("ERR_PROXY_CONNECTION_FAILED" in e for e in bad.log_errors), bad.log_errors
    assert bad.layout["overlaps"] == [["planted", "AAAA", "BBBB"]], bad.layout
    assert bad.layout["scroll_width"] > bad.layout["client_width"], bad.layout


AT_SCALE = ["diff-at-scale", "bisect-prefill-at-scale", "bisect-decode-at-scale"]


@pytest.mark.parametrize(
    "name", ["diff", "gate", "port", "python", "bisect", "bisect-decode", *AT_SCALE]
)
def test_no_chart_label_overprints_another_and_no_page_scrolls_sideways(rendered, name):
    """At the 1280-px window; diff-at-scale is 30 layers over 25 steps (750 layer groups, 3,002
    tensors), where the layer labels overprinted and the per-tensor table pushed the page wide;
    the bisect pages at scale are 30 layers, one of them over 24 decode steps."""
    layout = rendered[name].layout
    assert layout["overlaps"] == [], layout["overlaps"][:10]
    assert layout["scroll_width"] <= layout["client_width"], layout


@pytest.mark.parametrize(
    "name", ["diff", "gate", "port", "python", "bisect", "bisect-decode", *AT_SCALE]
)
def test_pages_are_self_contained_and_clean(rendered, name):
    r = rendered[name]
    assert r.png[:8] == b"\x89PNG\r\n\x1a\n" and len(r.png) > 10_000
    assert (r.console_errors, r.log_errors, r.foreign_requests()) == ([], [], [])
    assert not re.search(r"(?:https?:|//)[^\s\"'<>]*\.", r.dom.replace("http-equiv", "")), (
        "the page names a URL"
    )
    assert "<script" not in r.dom


def test_the_diff_page_shows_the_json_report(rendered, planted):
    for name in ("diff", "python"):  # trace-diff --html and Report.to_html: the same page
        rep = planted["diff"]
        dom = Dom(rendered[name].dom)
        assert check_numbers(dom, rep) > 23 * 9
        rows = rep["per_tensor"]
        for chart, field in (("chart-rel-l2", "rel_l2"), ("chart-max-ulp", "max_ulp")):
            svg = dom.by_id(chart)
            assert svg["data-n"] == str(len(rows))
            points = [
                e
                for e in dom.find(tag="circle")
                if e.get("data-json", "").endswith(f"/{field}")
                and e["data-json"].startswith("/per_tensor/")
            ]
            assert len(points) == sum(r[field] is not None for r in rows)
            fv = dom.by_id(f"{chart}-first-violation")
            assert (
                fv["data-names"]
                == rep["first_violation"]["tensor"]
                == rows[int(fv["data-x"])]["tensor"]
            )
            fbd = dom.by_id(f"{chart}-first-bit-difference")
            assert (
                fbd["data-names"]
                == rep["first_bit_difference"]["tensor"]
                == rows[int(fbd["data-x"])]["tensor"]
            )
        # The policy's bounds are drawn for every row whose rule sets one.
        bounds = [
            e
            for e in dom.find(tag="line")
            if "bound" in e.get("class", "").split() and e["data-json"].endswith("/max_rel_l2")
        ]
        assert len(bounds) == sum(
            1
            for r in rows
            if r["rule"] and "max_rel_l2" in rep["policy"]["bounds"][r["rule"]["index"]]
        )
        assert dom.by_id("first-violation")["data-tensor"] == rep["first_violation"]["tensor"]
        assert [
            e["data-tensor"]
            for e in dom.elements
            if "first-violation" in e.get("class", "").split() and e["tag"] == "tr"
        ] == [rep["first_violation"]["tensor"]]
        flips = [e["data-label"] for e in dom.find(tag="tr") if e.get("class") == "flip"]
        assert (
            flips
            == [f["label"] for r in rep["decisions"]["results"] for f in r["flips"]]
            == ["consequence"]
        )
        assert len([e for e in dom.find(tag="circle") if "margin" in e.get("class", "")]) == 1


def test_the_port_page_shows_the_json_report_and_where_the_defect_is(rendered, ported):
    """gate run port's page: every number tied to the report holds its value, the failing
    agrees links to its findings, and the localisation says layer 03, stage k."""
    rep = ported["report"]
    assert rep["prompts"][0]["localised"]["first_wrong_layer"] == 3
    dom = Dom(rendered["port"].dom)
    assert check_numbers(dom, rep) > 10
    layer = [
        e for e in dom.elements if e.get("data-json") == "/prompts/0/localised/first_wrong_layer"
    ]
    assert [e["text"] for e in layer] == ["3"]
    assert "layer.03.k" in dom.by_id("localised-0")["text"]
    agrees = next(i for i, c in enumerate(rep["prompts"][0]["checks"]) if c["check"] == "agrees")
    assert f"#finding-0-{agrees}" in {e["href"] for e in dom.find(tag="a")}


def test_the_gate_page_shows_the_json_report_and_links_failures_to_findings(rendered, planted):
    rep = planted["gate"]
    dom = Dom(rendered["gate"].dom)
    assert check_numbers(dom, rep) > 20
    cells = [
        e
        for e in dom.find(tag="td")
        if "check" in e.get("class", "").split() and e["data-json"].startswith("/prompts/")
    ]
    assert len(cells) == sum(len(p["checks"]) for p in rep["prompts"])
    failing = [
        (pi, ci)
        for pi, p in enumerate(rep["prompts"])
        for ci, c in enumerate(p["checks"])
        if c["status"] == "FAIL"
    ]
    assert [rep["prompts"][0]["checks"][ci]["check"] for _, ci in failing] == [
        "agrees",
        "generation_oracle",
    ]
    links = {e["href"] for e in dom.find(tag="a")}
    for pi, ci in failing:
        assert f"#finding-{pi}-{ci}" in links
        box = dom.by_id(f"finding-{pi}-{ci}")
        names = [
            e["data-name"]
            for e in dom.elements
            if e.get("class") == "finding" and e["data-name"] and e in box_children(dom, box)
        ]
        assert names == [f["name"] for f in rep["prompts"][pi]["checks"][ci]["findings"]]
    fv = dom.by_id("first-violation-0")
    assert (
        fv["data-tensor"]
        == rep["prompts"][0]["oracle"]["first_violation"]["tensor"]
        == "layer.01.mlp_out"
    )
    deltas = [
        e
        for e in dom.elements
        if e.get("data-json", "").startswith("/baselines/") and e["data-json"].endswith("/delta")
    ]
    assert len(deltas) == sum(len(b["observed"]) for b in rep["baselines"]) > 0


def assert_refused(check, dom: Dom, rep: dict, plants) -> None:
    """Negative controls: `check` of the page refuses each copy of `rep` a plant edited."""
    for i, plant in enumerate(plants):
        bad = json.loads(json.dumps(rep))
        plant(bad)
        with pytest.raises(AssertionError):
            check(dom, bad)
            pytest.fail(f"plant {i} was accepted")


def check_layers(dom: Dom, owner: dict, at: str, pfx: str, fields) -> None:
    """A table of layers (`at`: /layers or /decode/layers; element ids prefixed `pfx`) against
    `owner`, the JSON holding it with its first_wrong_layer and stage: one point per measured
    value and field, the wrong layer marked on the chart and in the table, its stage."""
    layers = owner["layers"]
    assert dom.by_id(f"{pfx}chart-layers")["data-n"] == str(len(layers))
    for field in fields:
        points = [
            e
            for e in dom.find(tag="circle")
            if re.fullmatch(rf"{at}/\d+/{field}", e.get("data-json", ""))
        ]
        assert [int(p["data-x"]) for p in points] == [
            i for i, l in enumerate(layers) if l[field] is not None
        ], field
    w = owner["first_wrong_layer"]
    assert int(dom.by_id(f"{pfx}chart-layers-wrong-layer")["data-x"]) == w
    assert dom.by_id(f"{pfx}wrong-layer")["data-layer"] == str(w)
    assert [
        int(e["data-layer"])
        for e in dom.find(tag="tr")
        if e.get("id", "").startswith(f"{pfx}layer-") and "wrong-layer" in e["class"].split()
    ] == [w]
    assert dom.by_id(f"{pfx}stage")["data-tensor"] == owner["stage"]["tensor"]


def check_bisect_page(dom: Dom, rep: dict) -> None:
    """The bisect page against its JSON: every tied number, one point per measured value and
    series, the wrong layer marked on the chart and in the table, its stage, the suspicious layers."""
    assert check_numbers(dom, rep) > 5 * 12
    layers = rep["layers"]
    check_layers(dom, rep, "/layers", "", ("whole_rel_l2", "isolated_rel_l2", "calibration_rel_l2"))
    assert dom.by_id("stage")["data-layer"] == str(rep["stage"]["layer"])
    suspicious = [
        e["data-x"] for e in dom.elements if e.get("id", "").startswith("chart-layers-suspicious-")
    ]
    assert suspicious == [str(i) for i, l in enumerate(layers) if l["suspicious"]]
    assert dom.by_id("verdict")["text"] == rep["verdict"].upper().replace("_", " ")


def test_the_bisect_page_shows_the_json_report(rendered, bisected):
    rep = bisected["report"]
    # The run this page is drawn from: the planted MLP of layer 02, calibrated.
    assert (rep["verdict"], rep["first_wrong_layer"], rep["stage"]["tensor"]) == (
        "wrong_layer",
        2,
        "layer.02.mlp_out",
    )
    assert sum(l["calibration_rel_l2"] is not None for l in rep["layers"]) == 3
    dom = Dom(rendered["bisect"].dom)
    check_bisect_page(dom, rep)
    # Negative controls: the same page against a JSON that says otherwise is refused.
    plants = [
        lambda r: r.__setitem__("first_wrong_layer", 1),
        lambda r: r["layers"][3].__setitem__("whole_rel_l2", r["layers"][3]["whole_rel_l2"] * 1.01),
        lambda r: r["layers"][0].__setitem__("suspicious", True),
        lambda r: r["layers"][4].__setitem__("calibration_rel_l2", None),
        lambda r: r["stage"].__setitem__("tensor", "layer.02.attn_out"),
    ]
    assert_refused(check_bisect_page, dom, rep, plants)


def check_decode_page(dom: Dom, rep: dict) -> None:
    """The decode part of a bisect page against its JSON: every tied number, one box per step
    (compared, the first diverging, not compared), that step, the cache check, and the layers
    isolated at that step (points, the wrong layer on the chart and in the table, its stage)."""
    assert check_numbers(dom, rep) > 5 * 12
    d = rep["decode"]
    assert dom.by_id("decode")["data-status"] == d["status"]
    assert dom.by_id("decode-steps")["data-n"] == str(d["generate"])
    boxes = [
        (int(e["data-step"]), e["class"])
        for e in dom.find(tag="g")
        if e.get("id", "").startswith("decode-step-")
    ]
    assert boxes == [
        (
            s,
            "step diverging"
            if s == d["first_diverging_step"]
            else "step compared"
            if s < d["steps_compared"]
            else "step not-compared",
        )
        for s in range(d["generate"])
    ]
    first = dom.by_id("decode-first-diverging")
    assert (first["data-step"], first["data-tensor"]) == (
        str(d["first_diverging_step"]),
        d["first_diverging"],
    )
    assert dom.by_id("decode-cache-check")["data-status"] == d["cache_check"]["status"]
    check_layers(dom, d, "/decode/layers", "decode-", ("whole_rel_l2", "isolated_rel_l2"))


def test_the_bisect_page_draws_the_decode_steps(rendered, bisected_decode):
    rep = bisected_decode["report"]
    d = rep["decode"]
    # The run this page is drawn from: step 1 diverges, the cached path disagrees with the full
    # recompute, and layer 01 is wrong in isolation at that step.
    assert (rep["verdict"], d["steps_compared"], d["first_diverging_step"]) == (
        "cached_decode_differs",
        2,
        1,
    )
    assert (d["cache_check"]["status"], d["first_wrong_layer"]) == ("disagrees", 1)
    dom = Dom(rendered["bisect-decode"].dom)
    check_decode_page(dom, rep)
    # Negative controls: the same page against a JSON that says otherwise is refused.
    plants = [
        lambda r: r["decode"].__setitem__("first_diverging_step", 0),
        lambda r: r["decode"].__setitem__("steps_compared", 3),
        lambda r: r["decode"]["cache_check"].__setitem__("status", "agrees"),
        lambda r: r["decode"].__setitem__("first_wrong_layer", 0),
        lambda r: r["decode"]["layers"][0].__setitem__(
            "isolated_rel_l2", (r["decode"]["layers"][0]["isolated_rel_l2"] or 0) + 1
        ),
        lambda r: r["decode"]["stage"].__setitem__("tensor", "layer.01.mlp_out"),
    ]
    assert_refused(check_decode_page, dom, rep, plants)


def test_the_bisect_pages_at_30_layers_show_their_json_reports(rendered, bisected_at_scale):
    """Every number on the pages of both 30-layer bisections is tied to its JSON, and each names
    the planted layer; a page checked against the other run's JSON is refused."""
    prefill, decode = (bisected_at_scale[p]["report"] for p in ("prefill", "decode"))
    assert (len(prefill["layers"]), prefill["first_wrong_layer"], prefill["stage"]["tensor"]) == (
        30,
        17,
        "layer.17.mlp_out",
    )
    assert [l["status"] for l in prefill["layers"]][16:19] == ["ok", "wrong", "downstream"]
    assert (decode["verdict"], decode["decode"]["first_wrong_layer"]) == (
        "cached_decode_differs",
        1,
    )
    prefill_dom = Dom(rendered["bisect-prefill-at-scale"].dom)
    decode_dom = Dom(rendered["bisect-decode-at-scale"].dom)
    check_bisect_page(prefill_dom, prefill)
    check_decode_page(decode_dom, decode)
    with pytest.raises(AssertionError):
        check_bisect_page(prefill_dom, bisected_at_scale["decode"]["report"])


def test_bisect_html_into_a_missing_directory_is_refused_before_any_run(tmp_path):
    out = tmp_path / "absent" / "b.html"
    r = run(
        [
            BIN / "gate",
            "--root",
            ROOT,
            "bisect",
            "--model",
            "fixtures/tiny-qwen3",
            "--prompt",
            "short",
            "--reference",
            "engine",
            "--candidate",
            "engine",
            "--work",
            tmp_path / "work",
            "--html",
            out,
        ]
    )
    want = f"--html {out}: directory {out.parent} does not exist"
    assert r.returncode == 2 and want in r.stderr, r.stderr
    assert not (tmp_path / "work").exists()


def box_children(dom: Dom, box: dict) -> list:
    """The elements inside `box` (those after it, up to the next finding box)."""
    i = dom.elements.index(box)
    out = []
    for e in dom.elements[i + 1 :]:
        if "finding" in e.get("class", "").split() and "box" in e.get("class", "").split():
            break
        out.append(e)
    return out


def test_gate_check_refuses_html():
    r = run([BIN / "gate", "--root", ROOT, "check", "--html", "x.html"])
    assert r.returncode == 2 and "gate check writes no HTML report" in r.stderr, r.stderr


def test_what_follows_a_near_tie_is_not_checked_in_process_and_never_passes(tmp_path):
    """An honest near-tie on the last prompt row sends the candidate's decode elsewhere: nothing
    judged fails, but the decode step was not judged. `compare` says not_checked (exit 4, not
    ok) and `assert_traces_agree` fails naming it — never a pass (docs/diff.md)."""
    rng = np.random.default_rng(7)
    logits = rng.standard_normal((2, 6)).astype(np.float32)
    logits[1, 3] = logits[1].max() + np.float32(0.5)
    logits[1, 4] = logits[1, 3] - np.float32(1e-4)  # the runner-up, 1e-4 below: honest f32 noise
    hidden = rng.standard_normal((1, 8)).astype(np.float32)

    def write(path, z, decode, producer):
        prov = {"producer": producer, "weights_digest": "w-1", "prompt_tokens": [5, 9]}
        with tracegate.TraceWriter(path, prov) as w:
            w.tensor("logits", z, path="prefill", mask="causal", positions=[0, 1])
            if decode is not None:
                w.tensor(
                    "decode.0000.layer.00.hidden_out",
                    decode,
                    path="decode",
                    mask="causal",
                    positions=[2],
                )
            top = np.argsort(-z, axis=1, kind="stable")
            margins = [float(z[r, top[r, 0]] - z[r, top[r, 1]]) for r in range(2)]
            w.decision("logits.argmax", top[:, 0].astype(np.int64), margins=margins)
        return path

    ref = write(tmp_path / "r.trace", logits, hidden, "engine")
    moved = logits.copy()
    moved[1, 3] -= np.float32(6e-5)
    moved[1, 4] += np.float32(6e-5)  # the candidate's own scores now pick 4
    cand = write(tmp_path / "c.trace", moved, hidden + np.float32(3.0), "my-port")
    report = tracegate.compare(ref, cand, policy="f32")
    flips = report.flipped_decisions
    assert [(f["decision"], f["row"], f["label"]) for f in flips] == [
        ("logits.argmax", 1, "near-tie")
    ], flips
    assert (report.verdict, report.exit_code, report.ok) == ("not_checked", 4, False)
    with pytest.raises(AssertionError) as failed:
        assert_traces_agree(ref, cand, policy="f32")
    assert str(failed.value).startswith("traces not checked: NOT CHECKED past a near-tie"), str(
        failed.value
    )
    # The control: the same near-tie with nothing after it (no decode step) is within the policy.
    ref2 = write(tmp_path / "r2.trace", logits, None, "engine")
    cand2 = write(tmp_path / "c2.trace", moved, None, "my-port")
    assert tracegate.compare(ref2, cand2, policy="f32").ok
    assert_traces_agree(ref2, cand2, policy="f32")
