"""The Chrome-trace timeline and the HTML report: structure of what they write."""

from __future__ import annotations

import base64
import json
import xml.etree.ElementTree as ET
from html.parser import HTMLParser

import pytest
from conftest import ROOT

import flexsearch
from flexsearch.api import resolve_cluster, simulate
from flexsearch.cli import main
from flexsearch.graph import trace
from flexsearch.report import COLOURS, convergence_figure, render
from flexsearch.search.planner import plan_graph

MLP = str(ROOT / "benchmarks/models/mlp.py:mlp_tiny")
GPT = str(ROOT / "benchmarks/models/gpt.py:gpt_tiny")


def _planned(spec: str, cluster: str, devices: int):
    model, inputs = flexsearch.load_model(spec)
    graph = trace(model, inputs, name=spec)
    plan = plan_graph(graph, resolve_cluster(cluster, devices), max_iters=60, seed=0, decentralized=False)
    return graph, plan, simulate(graph, plan)


@pytest.fixture(scope="module")
def soap():
    graph, plan, sim = _planned(MLP, "dgx-h100", 4)
    assert plan.kind in ("soap", "data")
    return graph, plan, sim


@pytest.fixture(scope="module")
def pipeline():
    """The best pipeline for GPT on 4 devices, with the search's baselines and curve (on
    a model this small DDP wins, so the planner would not return it)."""
    graph, base, _ = _planned(GPT, "pipedream-a", 4)
    plan = plan_graph(graph, resolve_cluster("pipedream-a", 4), kinds=("pipeline", "hybrid"), max_iters=0)
    plan = plan.model_copy(update={"baselines": {**base.baselines, **plan.baselines}, "search": base.search})
    assert plan.kind in ("pipeline", "hybrid")
    return graph, plan, simulate(graph, plan)


# -- the timeline ----------------------------------------------------------------------
def _tracks(events):
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    slices: dict[tuple[int, int], list[dict]] = {}
    for e in events:
        if e["ph"] == "X":
            slices.setdefault((e["pid"], e["tid"]), []).append(e)
    return names, slices


@pytest.mark.parametrize("which", ["soap", "pipeline"])
def test_chrome_trace_tracks_and_bubbles(which, request, tmp_path):
    _, plan, sim = request.getfixturevalue(which)
    path = tmp_path / "timeline.json"
    returned = sim.to_chrome_trace(path)
    loaded = json.loads(path.read_text())  # valid JSON: no NaN, nothing Perfetto rejects
    assert loaded == returned
    events = loaded["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert processes == {0: "devices", 1: "links"}
    names, slices = _tracks(events)
    assert [names[(0, d)] for d in range(plan.devices)] == [f"device {d}" for d in range(plan.devices)]
    assert sorted(n for (pid, _), n in names.items() if pid == 1) == sorted(f"link {x}" for x in sim.link_names)
    assert set(slices) <= set(names)
    for (pid, _), track in slices.items():
        cats = {e["cat"] for e in track}
        assert cats <= ({"fwd", "bwd", "update", "bubble"} if pid == 0 else {"xfer", "coll"})
        assert {e["args"]["kind"] for e in track} <= ({"compute", "idle"} if pid == 0 else {"communication"})
        track.sort(key=lambda e: e["ts"])
        for e in track:
            assert e["dur"] >= 0 and e["ts"] >= 0
        for a, b in zip(track, track[1:], strict=False):
            end = a["ts"] + a["dur"]
            assert end <= b["ts"] + 1e-9 * end  # one resource, one task at a time: no overlap
            if pid == 0:  # bubbles fill every idle gap between a device's first and last task
                assert end == pytest.approx(b["ts"], rel=1e-12, abs=1e-12), (a, b)
                assert not (a["cat"] == "bubble" and b["cat"] == "bubble")
    device_cats = {e["cat"] for (pid, _), t in slices.items() if pid == 0 for e in t}
    assert {"fwd", "bwd", "update"} <= device_cats
    assert any(pid == 1 for pid, _ in slices), "communication on the links"
    end = max(e["ts"] + e["dur"] for t in slices.values() for e in t)
    assert end == pytest.approx(sim.iteration_time_s * 1e6, rel=1e-9)
    assert loaded["otherData"]["iteration_time_s"] == sim.iteration_time_s


def test_pipeline_trace_shows_bubbles(pipeline):
    _, plan, sim = pipeline
    _, slices = _tracks(sim.to_chrome_trace()["traceEvents"])
    bubbles = [e for (pid, _), t in slices.items() if pid == 0 for e in t if e["cat"] == "bubble"]
    assert bubbles and all(e["dur"] > 0 for e in bubbles)
    # every stage's devices compute
    busy = {tid for (pid, tid), t in slices.items() if pid == 0 and any(e["cat"] == "fwd" for e in t)}
    assert busy == set(range(plan.devices))


# -- the report -------------------------------------------------------------------------
class _Page(HTMLParser):
    def __init__(self):
        super().__init__()
        self.title = ""
        self.figures = 0
        self.imgs: list[dict] = []
        self.tables: list[dict] = []
        self.urls: list[str] = []
        self._stack: list[str] = []
        self._cell: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self._stack.append(tag)
        if tag == "figure":
            self.figures += 1
        elif tag == "img":
            self.imgs.append(a)
        elif tag == "table":
            self.tables.append({"class": a.get("class", ""), "rows": []})
        elif tag == "tr":
            self.tables[-1]["rows"].append([])
        elif tag in ("td", "th"):
            self._cell = []
        for k in ("src", "href"):
            if a.get(k):
                self.urls.append(a[k])

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self.tables[-1]["rows"][-1].append("".join(self._cell).strip())
            self._cell = None
        if self._stack and self._stack[-1] == tag:
            self._stack.pop()

    def handle_startendtag(self, tag, attrs):
        self.handle_starttag(tag, attrs)
        if self._stack and self._stack[-1] == tag:
            self._stack.pop()

    def handle_data(self, data):
        if self._stack and self._stack[-1] == "title":
            self.title += data
        if self._cell is not None:
            self._cell.append(data)


def _parse(page: str) -> _Page:
    p = _Page()
    p.feed(page)
    p.close()
    return p


def _svg(img: dict) -> ET.Element:
    prefix = "data:image/svg+xml;base64,"
    assert img["src"].startswith(prefix)
    return ET.fromstring(base64.b64decode(img["src"][len(prefix):]))


@pytest.mark.parametrize("which", ["soap", "pipeline"])
def test_report_structure(which, request):
    _, plan, sim = request.getfixturevalue(which)
    page = render(plan, sim)
    p = _parse(page)
    assert page.startswith("<!DOCTYPE html>")
    assert plan.model in p.title and str(plan.devices) in p.title
    assert p.figures == 4 and len(p.imgs) == 4
    for img in p.imgs:
        assert len(img.get("alt", "")) > 20
    alts = [img["alt"] for img in p.imgs]
    assert alts[0].startswith("Timeline") and "memory" in alts[1].lower()
    assert "MCMC" in alts[2] and "baselines" in alts[3]
    # self-contained: every src is inline data, no link anywhere leaves the page
    assert all(u.startswith("data:") for u in p.urls)
    assert "http://" not in page and "https://" not in page
    svgs = [_svg(img) for img in p.imgs]
    ns = "{http://www.w3.org/2000/svg}"
    timeline_fills = {r.get("fill") for r in svgs[0].iter(f"{ns}rect")}
    assert {COLOURS["compute"], COLOURS["communication"]} <= timeline_fills
    if which == "pipeline":
        assert COLOURS["bubble"] in timeline_fills
    memory_bars = [r for r in svgs[1].iter(f"{ns}rect") if r.get("fill") == COLOURS["compute"]]
    assert len(memory_bars) >= plan.devices  # one per device (+ the legend's swatch)
    assert any("capacity" in (t.text or "") for t in svgs[1].iter(f"{ns}text"))
    assert list(svgs[2].iter(f"{ns}polyline")), "the convergence curve"
    labels = [t.text or "" for t in svgs[3].iter(f"{ns}text")]
    assert any(s.startswith("baseline data") for s in labels) and any("lower bound" in s for s in labels)
    baselines = next(t for t in p.tables if t["class"] == "baselines")
    first_col = [row[0] for row in baselines["rows"][1:]]
    assert first_col[0] == "this plan" and "data" in first_col and first_col[-1] == "lower bound"
    assert set(plan.baselines) | set(plan.infeasible_baselines) <= set(first_col)


def test_report_without_search_curve(soap):
    _, plan, sim = soap
    bare = plan.model_copy(update={"search": plan.search.model_copy(update={"curve": ()})})
    p = _parse(render(bare, sim))
    assert p.figures == 4 and "no search curve" in p.imgs[2]["alt"]
    fig = convergence_figure((), 0, plan.predicted.iteration_time_s)
    assert "no search curve" in base64.b64decode(fig.html().split("base64,")[1].split('"')[0]).decode()


def test_report_command(tmp_path, capsys):
    plan_file, page = tmp_path / "plan.json", tmp_path / "report.html"
    assert main(["plan", MLP, "--devices", "2", "--max-iters", "20", "--out", str(plan_file), "--json"]) == 0
    capsys.readouterr()
    assert main(["report", str(plan_file), "--out", str(page)]) == 0
    out, err = capsys.readouterr()
    assert "report written to" in out and page.exists()
    p = _parse(page.read_text())
    assert p.figures == 4 and "mlp_tiny" in p.title
    before = page.read_bytes()
    assert main(["report", str(plan_file), "--out", str(page)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "--force" in err and len(err.strip().splitlines()) == 1
    assert page.read_bytes() == before
    assert main(["report", str(plan_file), "--out", str(page), "--force"]) == 0


def test_report_says_a_calibration_warning_in_one_line(tmp_path, capsys, monkeypatch):
    """On the ``cpu`` cluster with a calibration from another host (forced here), the
    report prints the one ``warning:`` line plan and simulate print, not Python's
    warning with its source line."""
    import warnings

    import flexsearch.api as api
    from flexsearch.errors import CalibrationWarning

    plan_file, page = tmp_path / "plan.json", tmp_path / "report.html"
    assert main(["plan", MLP, "--devices", "2", "--cluster", "cpu", "--max-iters", "5", "--out", str(plan_file),
                 "--json"]) == 0
    capsys.readouterr()
    monkeypatch.setattr(api, "calibration_warning",
                        lambda calibration, cluster: "measured on another host" if cluster.name == "cpu" else None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["report", str(plan_file), "--out", str(page)]) == 0
    _, err = capsys.readouterr()
    assert err.strip() == "warning: measured on another host"
    assert not [w for w in caught if issubclass(w.category, CalibrationWarning)]


def test_line_figure_draws_every_non_empty_series():
    from flexsearch.report import line_figure

    fig = line_figure({"all-reduce": [(0.0, 2.3), (1.5, 1.0), (3.0, 0.2)], "ring": [(0.0, 2.3), (0.5, 0.9)],
                       "empty": []}, "simulated wall-clock (s)", "training loss", "caption")
    root = ET.fromstring(fig.svg)
    lines = [e for e in root.iter() if e.tag.endswith("polyline")]
    assert len(lines) == 2
    points = [[tuple(map(float, p.split(","))) for p in e.get("points").split()] for e in lines]
    assert [len(p) for p in points] == [3, 2]
    # shared axes: the ring's last point (x = 0.5) lies left of all-reduce's second (x = 1.5)
    assert points[1][1][0] < points[0][1][0]
    assert "all-reduce" in fig.alt and "ring" in fig.alt and "empty" not in fig.alt
    assert fig.caption in fig.html()
