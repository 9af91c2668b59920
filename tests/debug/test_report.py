"""``graphopt debug --report``: a self-contained HTML page that renders in a browser, with
readable pictures of each change (built-in layout, or Graphviz when installed)."""

import os
import re
import shutil
import subprocess
import xml.etree.ElementTree as ET

import pytest
import torch
from torch import nn

from graphopt.debug import dot, html_report
from graphopt.debug.graph_view import change_views
from graphopt.debug.svg_layout import layers_of, render_svg
from graphopt.pass_manager import PassContext, PassManager
from graphopt.registry import get_pass
from tests.debug.conftest import RMS_PIPELINE, debug_json
from tests.helpers import aten_graph

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SVG = "{http://www.w3.org/2000/svg}"


class NormChain(nn.Module):
    """``layers`` x (linear, RMSNorm): a graph with one fusion spot per layer."""

    def __init__(self, layers: int = 2, width: int = 16):
        super().__init__()
        self.linears = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(layers))
        self.weights = nn.ParameterList(nn.Parameter(torch.rand(width) + 0.5) for _ in range(layers))

    def forward(self, x):
        for linear, w in zip(self.linears, self.weights):
            x = linear(x)
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
        return x


def _fused(layers: int):
    x = torch.randn(2, 16)
    gm = aten_graph(NormChain(layers), x)
    after = PassManager([get_pass("fuse_rms_norm")]).run(gm, PassContext(None, [x])).gm
    return gm, after


def _chromium(*args: str, tmp_path) -> subprocess.CompletedProcess:
    return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                           "--disable-component-update", "--disable-sync", "--no-first-run",
                           f"--user-data-dir={tmp_path / 'profile'}", *args],
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    path = tmp_path_factory.mktemp("report") / "out.html"
    data = debug_json("llama-tiny", "--report", str(path), "--bisect")
    return path, data


def test_report_is_written_and_self_contained(page):
    path, data = page
    html = path.read_text()
    assert data["report"]["path"] == str(path) and data["report"]["bytes"] == len(html.encode())
    assert not re.search(r"<script|<link|<img|<iframe|@import|\bsrc=|url\(\s*['\"]?http", html, flags=re.I)
    namespaces = {"http://www.w3.org/2000/svg", "http://www.w3.org/1999/xlink"}  # names, never fetched
    assert set(re.findall(r"https?://[^\s\"'<>)]+", html)) <= namespaces
    changed = [p["name"] for p in data["graphs"][0]["passes"] if p["status"] == "changed"]
    assert changed and html.count('<section class="change"') == len(changed)
    assert html.count("<svg") == 2 * len(changed)  # before and after each change
    assert 'id="pipeline"' in html and 'id="passes-0"' in html and "numeric check" in html
    assert "Bisect" in html and "within tolerance" in html


def test_report_renders_in_headless_chromium(page, tmp_path):
    if CHROMIUM is None:
        if os.environ.get("CI") == "true":  # CI must render the page: a skip there would hide a broken page
            pytest.fail("Chromium is missing in CI: scripts/install.sh installs it (scripts/install_chromium.sh)")
        pytest.skip("Chromium is not installed (Debian: apt-get install chromium, or scripts/install_chromium.sh as root)")
    path, data = page
    dom = _chromium("--dump-dom", path.as_uri(), tmp_path=tmp_path)
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert '<table id="pipeline">' in dom.stdout and "<svg" in dom.stdout
    for p in data["graphs"][0]["passes"]:
        assert f"<code>{p['name']}</code>" in dom.stdout
    shot = tmp_path / "page.png"
    result = _chromium(f"--screenshot={shot}", "--window-size=1200,2000", path.as_uri(), tmp_path=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000  # a blank page compresses far smaller


def test_builtin_layout_draws_every_node_with_edges_pointing_down():
    before, after = _fused(2)
    old, new = change_views(before, after, "fuse_rms_norm")
    assert not old.note  # a small graph is drawn whole
    for view in (old, new):
        svg = ET.fromstring(render_svg(view, uid="t"))
        groups = svg.findall(f"{SVG}g")
        assert sorted(g.get("data-name") for g in groups) == sorted(n.name for n in view.nodes)
        width, height = float(svg.get("width")), float(svg.get("height"))
        for rect in svg.iter(f"{SVG}rect"):
            x, y, w = float(rect.get("x")), float(rect.get("y")), float(rect.get("width"))
            assert 0 <= x and x + w <= width and 0 <= y <= height
        row = {name: i for i, names in enumerate(layers_of(view)) for name in names}
        assert all(row[src] < row[dst] for src, dst in view.edges)
        assert len(svg.findall(f"{SVG}path")) == len(view.edges)
    created = {n.name for n in new.nodes if n.state == "new"}
    assert created and all(name.startswith("rms_norm") for name in created)
    svg = render_svg(new, uid="t")
    assert all(f'<g class="node new" data-name="{name}">' in svg for name in created)
    removed = {n.name for n in old.nodes if n.state == "removed"}
    assert {"rsqrt", "rsqrt_1", "mean", "pow_1"} <= removed


def test_big_graphs_show_whole_changed_spots_up_to_the_cap():
    before, after = _fused(12)
    assert len(before.graph.nodes) > 100
    old, new = change_views(before, after, "fuse_rms_norm", max_nodes=40)
    assert len(old.nodes) <= 40 and len(new.nodes) <= 40
    assert "changed spots" in old.note and old.note == new.note
    shown = {n.name for n in old.nodes}
    assert {"pow_1", "mean", "add", "rsqrt", "mul", "mul_1"} <= shown  # the first spot, whole
    assert "rsqrt_11" not in shown  # the last layer's spot did not fit


def test_dot_renderer_falls_back_to_the_builtin_layout_when_dot_fails(monkeypatch):
    before, after = _fused(1)

    def broken(view):
        raise RuntimeError("dot failed: planted")

    monkeypatch.setattr(dot, "render_dot", broken)
    data = {"model": "m", "pipeline": "fuse_rms_norm", "graphs": [
        {"graph": 0, "passes": [{"name": "fuse_rms_norm", "status": "changed", "matches": 1, "time_ms": 1.0,
                                 "nodes_before": 1, "nodes_after": 1, "numerics": None, "error": None}],
         "near_misses": [], "first_bad_pass": None}]}
    html = html_report.render_report(data, [[("fuse_rms_norm", before, after)]], renderer="dot")
    assert html.count("dot failed: planted; built-in layout instead") == 2 and html.count("<svg") == 2


@pytest.mark.skipif(not dot.dot_available(), reason="Graphviz dot is not installed")
def test_graphviz_pictures_when_dot_is_installed():
    before, after = _fused(1)
    old, new = change_views(before, after, "fuse_rms_norm")
    svg = dot.render_dot(new)
    assert svg.startswith("<svg") and "graphopt.rms_norm" in svg and "#d5f5d5" in svg.lower()


def test_report_page_for_a_failing_pass_names_the_reproducer(planted, tmp_path):
    path = tmp_path / "page.html"
    data = debug_json("llama-tiny", "--pipeline", RMS_PIPELINE + ",explode", "--report", str(path),
                      "--reproducer", str(tmp_path / "repro"))
    html = path.read_text()
    assert data["reproducer"]["pass"] == "explode"
    assert "Reproducer" in html and f"graphopt debug --replay {tmp_path / 'repro'}" in html
    assert "RuntimeError: boom: planted failure" in html
