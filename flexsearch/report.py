"""``flexsearch report``: one self-contained HTML page about a plan.

:func:`render` takes a plan and its re-simulation and returns the page: a summary
table, four figures and a table of the baselines. The figures are SVG drawn here (no
plotting library), embedded as ``data:`` images with alt text, so the page needs no
network and no other file:

1. the simulated iteration's timeline, from :meth:`Simulation.to_chrome_trace`: one
   row per device and per busy link; compute, communication and bubbles (idle gaps on
   a device) in three colours;
2. memory per device against the device's capacity;
3. the search's convergence: best predicted iteration time vs MCMC iterations
   (``plan.search.curve``), or a note that there is no curve;
4. the plan against its baselines and the lower bound.
"""

from __future__ import annotations

import base64
import html
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from flexsearch.plan import Plan
from flexsearch.sim.result import Simulation

COLOURS = {"compute": "#4e79a7", "communication": "#f28e2b", "bubble": "#d0d0d0"}
_FONT = "font-family='sans-serif' font-size='11'"
_WIDTH = 900


@dataclass(frozen=True)
class Figure:
    """One picture of the page: its SVG source, alt text and caption."""

    svg: str
    alt: str
    caption: str

    def html(self) -> str:
        data = base64.b64encode(self.svg.encode()).decode()
        return (f'<figure><img src="data:image/svg+xml;base64,{data}" alt="{html.escape(self.alt)}">'
                f"<figcaption>{html.escape(self.caption)}</figcaption></figure>")


# -- scales and units ----------------------------------------------------------------
def _time_unit(seconds: float) -> tuple[float, str]:
    """(scale, unit) that shows ``seconds`` as a number between 1 and 1000 or so."""
    if seconds >= 10:
        return 1.0, "s"
    if seconds >= 1e-3:
        return 1e3, "ms"
    return 1e6, "us"


def _fmt_time(seconds: float) -> str:
    scale, unit = _time_unit(seconds)
    return f"{seconds * scale:.4g} {unit}"


def fmt_bytes(n: float) -> str:
    for scale, unit in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def _ticks(hi: float, n: int = 5) -> list[float]:
    """Round tick values from 0 to about ``hi``."""
    if not hi > 0 or not math.isfinite(hi):
        return [0.0]
    raw = hi / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    return [i * step for i in range(int(hi / step + 1e-9) + 1)]


def _svg(width: int, height: int, body: list[str]) -> str:
    return (f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' "
            f"viewBox='0 0 {width} {height}' {_FONT}><rect width='100%' height='100%' fill='white'/>"
            + "".join(body) + "</svg>")


def _text(x: float, y: float, s: str, anchor: str = "start", extra: str = "") -> str:
    return f"<text x='{x:.1f}' y='{y:.1f}' text-anchor='{anchor}' {extra}>{html.escape(s)}</text>"


def _legend(x: float, y: float, items: Sequence[tuple[str, str]]) -> list[str]:
    out = []
    for label, colour in items:
        out.append(f"<rect x='{x:.1f}' y='{y - 9:.1f}' width='10' height='10' fill='{colour}'/>")
        out.append(_text(x + 14, y, label))
        x += 24 + 7 * len(label)
    return out


# -- figure 1: the timeline ------------------------------------------------------------
def timeline_figure(sim: Simulation) -> Figure:
    """Each device and each busy link as a row; slices merged below a pixel."""
    trace = sim.to_chrome_trace()
    names: dict[tuple[int, int], str] = {}
    rows: dict[tuple[int, int], list[tuple[float, float, str]]] = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "M" and e["name"] == "thread_name":
            names[(e["pid"], e["tid"])] = e["args"]["name"]
        elif e["ph"] == "X":
            cat = "bubble" if e["cat"] == "bubble" else e["args"]["kind"]  # compute, communication
            rows.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"], cat))
    devices = sorted(k for k in names if k[0] == 0)
    links = sorted(k for k in names if k[0] == 1 and k in rows)
    shown = devices + links
    total_us = max(sim.iteration_time_s * 1e6, max((b for r in rows.values() for _, b, _ in r), default=0.0))
    scale, unit = _time_unit(total_us / 1e6)
    left, right, top, row_h = 150, 20, 34, 14
    plot_w = _WIDTH - left - right
    height = top + row_h * len(shown) + 40
    px = plot_w / total_us if total_us > 0 else 0.0
    body = _legend(left, 16, [(c, COLOURS[c]) for c in ("compute", "communication", "bubble")])
    for i, key in enumerate(shown):
        y = top + i * row_h
        label = names[key] if len(names[key]) <= 22 else names[key][:21] + "…"
        body.append(_text(left - 6, y + row_h - 3, label, "end"))
        merged: list[list] = []
        for a, b, cat in sorted(rows.get(key, ())):
            x0, x1 = a * px, b * px
            if merged and merged[-1][2] == cat and x0 - merged[-1][1] < 0.5:
                merged[-1][1] = max(merged[-1][1], x1)
            else:
                merged.append([x0, x1, cat])
        for x0, x1, cat in merged:
            body.append(f"<rect x='{left + x0:.2f}' y='{y + 1}' width='{max(x1 - x0, 0.4):.2f}' "
                        f"height='{row_h - 2}' fill='{COLOURS.get(cat, '#888')}'/>")
    axis_y = top + row_h * len(shown) + 4
    body.append(f"<line x1='{left}' y1='{axis_y}' x2='{left + plot_w}' y2='{axis_y}' stroke='black'/>")
    for t in _ticks(total_us / 1e6 * scale):
        x = left + t / scale * 1e6 * px
        body.append(f"<line x1='{x:.1f}' y1='{axis_y}' x2='{x:.1f}' y2='{axis_y + 4}' stroke='black'/>")
        body.append(_text(x, axis_y + 16, f"{t:g}", "middle"))
    body.append(_text(left + plot_w, axis_y + 30, f"time ({unit})", "end"))
    idle_links = len(sim.link_names) - len(links)
    alt = (f"Timeline of one simulated iteration ({_fmt_time(sim.iteration_time_s)}): "
           f"{len(devices)} device rows and {len(links)} link rows; compute, communication "
           "and idle bubbles coloured")
    caption = (f"Simulated iteration: {_fmt_time(sim.iteration_time_s)}. Blue: compute (forward, "
               "backward, optimizer update); orange: transfers and collectives on the links they "
               "load; grey: bubbles, a device idle between its first and last task."
               + (f" {idle_links} idle link(s) not shown." if idle_links else "")
               + " For the full trace, use `flexsearch simulate PLAN.json --trace timeline.json` "
               "and open it in Perfetto.")
    return Figure(_svg(_WIDTH, height, body), alt, caption)


# -- figure 2: memory per device ---------------------------------------------------------
def memory_figure(memory: Sequence[float], capacity: float) -> Figure:
    """A bar per device; the capacity as a dashed line; bars over it in red."""
    left, right, top, bottom, h = 70, 20, 30, 40, 220
    plot_w = _WIDTH - left - right
    hi = max([capacity, *memory]) * 1.1 if memory else capacity
    unit_scale = 2**30
    body = _legend(left, 16, [("memory", COLOURS["compute"]), ("over capacity", "#d62728")])
    n = max(len(memory), 1)
    bar_w = plot_w / n

    def y_of(v: float) -> float:
        return top + h - (v / hi * h if hi > 0 else 0.0)

    for t in _ticks(hi / unit_scale):
        y = y_of(t * unit_scale)
        body.append(f"<line x1='{left}' y1='{y:.1f}' x2='{left + plot_w}' y2='{y:.1f}' stroke='#eee'/>")
        body.append(_text(left - 6, y + 4, f"{t:g}", "end"))
    body.append(_text(14, top + h / 2, "GiB", "middle"))
    for d, m in enumerate(memory):
        y = y_of(m)
        colour = "#d62728" if m > capacity else COLOURS["compute"]
        gap = min(2.0, bar_w * 0.2)
        body.append(f"<rect x='{left + d * bar_w + gap / 2:.2f}' y='{y:.2f}' width='{bar_w - gap:.2f}' "
                    f"height='{top + h - y:.2f}' fill='{colour}'/>")
    step = max(1, math.ceil(n / 32))
    for d in range(0, len(memory), step):
        body.append(_text(left + (d + 0.5) * bar_w, top + h + 14, str(d), "middle"))
    body.append(_text(left + plot_w / 2, top + h + 30, "device", "middle"))
    cy = y_of(capacity)
    body.append(f"<line x1='{left}' y1='{cy:.1f}' x2='{left + plot_w}' y2='{cy:.1f}' stroke='#d62728' "
                "stroke-dasharray='6 4'/>")
    body.append(_text(left + plot_w, cy - 4, f"capacity {fmt_bytes(capacity)}", "end"))
    peak = max(memory, default=0.0)
    over = sum(m > capacity for m in memory)
    alt = (f"Bar chart of memory per device for {len(memory)} devices: peak {fmt_bytes(peak)} "
           f"against a capacity of {fmt_bytes(capacity)}"
           + (f"; {over} device(s) over capacity" if over else ""))
    caption = (f"Memory per device (parameters, gradients, optimizer state, activations): peak "
               f"{fmt_bytes(peak)}, {peak / capacity:.0%} of the {fmt_bytes(capacity)} capacity."
               if capacity > 0 else "Memory per device.")
    return Figure(_svg(_WIDTH, top + h + bottom, body), alt, caption)


# -- figure 3: convergence ----------------------------------------------------------------
def convergence_figure(curve: Sequence[tuple[int, float]], iterations: int, plan_time_s: float) -> Figure:
    """Best predicted iteration time after each MCMC iteration (a step line)."""
    left, right, top, bottom, h = 80, 20, 30, 40, 220
    plot_w = _WIDTH - left - right
    if not curve:
        body = [_text(_WIDTH / 2, top + h / 2, "no search curve: the MCMC search recorded no plan that fits",
                      "middle", "font-size='14'")]
        return Figure(_svg(_WIDTH, top + h + bottom, body),
                      "no search curve: the plan records no MCMC improvements",
                      "No search curve: the op-level MCMC search found no plan that fits in memory, "
                      "did not run (a graph too large for it), or the plan file predates the curve.")
    xs_hi = max(iterations, curve[-1][0], 1)
    ts = [t for _, t in curve] + [plan_time_s]
    lo_t, hi_t = min(ts), max(ts)
    scale, unit = _time_unit(hi_t)
    pad = (hi_t - lo_t) * 0.1 or hi_t * 0.05 or 1e-9
    y_lo, y_hi = max(0.0, lo_t - pad), hi_t + pad

    def x_of(i: float) -> float:
        return left + i / xs_hi * plot_w

    def y_of(t: float) -> float:
        return top + h - (t - y_lo) / (y_hi - y_lo) * h

    body = _legend(left, 16, [("best MCMC plan", COLOURS["compute"]), ("returned plan", "#59a14f")])
    span = (y_hi - y_lo) * scale
    for t in _ticks(span):
        v = y_lo + t / scale
        y = y_of(v)
        body.append(f"<line x1='{left}' y1='{y:.1f}' x2='{left + plot_w}' y2='{y:.1f}' stroke='#eee'/>")
        body.append(_text(left - 6, y + 4, f"{v * scale:.4g}", "end"))
    for i in _ticks(xs_hi):
        body.append(_text(x_of(i), top + h + 14, f"{i:g}", "middle"))
    body.append(_text(left + plot_w / 2, top + h + 30, "MCMC iteration", "middle"))
    body.append(_text(14, top + h / 2, unit, "middle"))
    pts: list[str] = []
    for k, (i, t) in enumerate(curve):
        if k:
            pts.append(f"{x_of(i):.1f},{y_of(curve[k - 1][1]):.1f}")
        pts.append(f"{x_of(i):.1f},{y_of(t):.1f}")
    pts.append(f"{x_of(xs_hi):.1f},{y_of(curve[-1][1]):.1f}")
    body.append(f"<polyline points='{' '.join(pts)}' fill='none' stroke='{COLOURS['compute']}' stroke-width='2'/>")
    for i, t in curve:
        body.append(f"<circle cx='{x_of(i):.1f}' cy='{y_of(t):.1f}' r='3' fill='{COLOURS['compute']}'/>")
    py = y_of(plan_time_s)
    body.append(f"<line x1='{left}' y1='{py:.1f}' x2='{left + plot_w}' y2='{py:.1f}' stroke='#59a14f' "
                "stroke-dasharray='6 4'/>")
    first, last = curve[0][1], curve[-1][1]
    alt = (f"Line chart of the best predicted iteration time against MCMC iterations: from "
           f"{_fmt_time(first)} to {_fmt_time(last)} in {len(curve) - 1} improvement(s) over "
           f"{iterations} iterations")
    caption = (f"Search convergence: the best plan the MCMC search had found after each iteration "
               f"({len(curve) - 1} improvement(s) after the best seed, {first / last:.2f}x in all). "
               "Dashed: the returned plan (a pipeline search runs after the MCMC and may win).")
    return Figure(_svg(_WIDTH, top + h + bottom, body), alt, caption)


# -- a line chart (benchmarks' pages) ---------------------------------------------------------
SERIES_COLOURS = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#b07aa1")


def line_figure(series: Mapping[str, Sequence[tuple[float, float]]], xlabel: str, ylabel: str,
                caption: str) -> Figure:
    """One polyline with markers per named series of ``(x, y)`` points, on shared linear
    axes from 0 (empty series are left out)."""
    left, right, top, bottom, h = 80, 20, 30, 44, 260
    plot_w = _WIDTH - left - right
    pts = [p for s in series.values() for p in s if math.isfinite(p[0]) and math.isfinite(p[1])]
    x_hi = max((x for x, _ in pts), default=1.0) or 1.0
    y_hi = max((y for _, y in pts), default=1.0) or 1.0
    xt, yt = _ticks(x_hi), _ticks(y_hi)
    x_hi, y_hi = max(x_hi, xt[-1]), max(y_hi, yt[-1])

    def x_of(x: float) -> float:
        return left + x / x_hi * plot_w

    def y_of(y: float) -> float:
        return top + h - y / y_hi * h

    names = [k for k, s in series.items() if s]
    colours = {k: SERIES_COLOURS[i % len(SERIES_COLOURS)] for i, k in enumerate(names)}
    body = _legend(left, 16, [(k, colours[k]) for k in names])
    for v in yt:
        body.append(f"<line x1='{left}' y1='{y_of(v):.1f}' x2='{left + plot_w}' y2='{y_of(v):.1f}' stroke='#eee'/>")
        body.append(_text(left - 6, y_of(v) + 4, f"{v:.4g}", "end"))
    for v in xt:
        body.append(_text(x_of(v), top + h + 14, f"{v:.4g}", "middle"))
    body.append(_text(left + plot_w / 2, top + h + 32, xlabel, "middle"))
    body.append(_text(14, top + h / 2, ylabel, "middle", f"transform='rotate(-90 14 {top + h / 2:.1f})'"))
    for k in names:
        xy = [(x_of(x), y_of(y)) for x, y in series[k] if math.isfinite(x) and math.isfinite(y)]
        body.append(f"<polyline points='{' '.join(f'{a:.1f},{b:.1f}' for a, b in xy)}' fill='none' "
                    f"stroke='{colours[k]}' stroke-width='2'/>")
        body.extend(f"<circle cx='{a:.1f}' cy='{b:.1f}' r='2.5' fill='{colours[k]}'/>" for a, b in xy)
    alt = f"Line chart of {ylabel} against {xlabel} for " + ", ".join(names)
    return Figure(_svg(_WIDTH, top + h + bottom, body), alt, caption)


# -- figure 4: plan vs baselines and the lower bound --------------------------------------
def comparison_figure(plan: Plan) -> Figure:
    """Horizontal bars: the plan, each baseline that fits, the lower bound."""
    bars = [("this plan" + f" ({plan.kind})", plan.predicted.iteration_time_s, "#59a14f")]
    bars += [(f"baseline {k}", t, COLOURS["compute"]) for k, t in sorted(plan.baselines.items(), key=lambda kv: kv[1])]
    bars.append(("lower bound (1 device / N)", plan.lower_bound_s, "#bab0ac"))
    rows = bars + [(f"baseline {k}", math.nan, "") for k in plan.infeasible_baselines]
    left, right, top, row_h = 190, 150, 30, 22
    plot_w = _WIDTH - left - right
    hi = max(t for _, t, _ in bars) * 1.05 or 1.0
    scale, unit = _time_unit(hi)
    body = []
    for i, (label, t, colour) in enumerate(rows):
        y = top + i * row_h
        body.append(_text(left - 6, y + row_h - 7, label, "end"))
        if math.isnan(t):
            body.append(_text(left + 4, y + row_h - 7, "does not fit in memory", extra="fill='#d62728'"))
            continue
        w = t / hi * plot_w
        body.append(f"<rect x='{left}' y='{y + 3}' width='{max(w, 0.5):.2f}' height='{row_h - 6}' fill='{colour}'/>")
        ratio = t / plan.predicted.iteration_time_s
        body.append(_text(left + w + 4, y + row_h - 7, f"{t * scale:.4g} {unit} ({ratio:.2f}x)"))
    axis_y = top + row_h * len(rows) + 4
    body.append(f"<line x1='{left}' y1='{axis_y}' x2='{left + plot_w}' y2='{axis_y}' stroke='black'/>")
    for t in _ticks(hi * scale):
        x = left + t / scale / hi * plot_w
        body.append(_text(x, axis_y + 14, f"{t:g}", "middle"))
    body.append(_text(left + plot_w, axis_y + 28, f"predicted iteration time ({unit})", "end"))
    names = ", ".join(f"{k} {_fmt_time(t)}" for k, t in sorted(plan.baselines.items()))
    alt = (f"Bar chart of predicted iteration times: this plan {_fmt_time(plan.predicted.iteration_time_s)}, "
           f"baselines {names or 'none that fit'}, lower bound {_fmt_time(plan.lower_bound_s)}")
    caption = ("The plan against its baselines (each simulated by the same cost model) and the lower "
               "bound (single-device time / N, memory ignored); the ratio is to this plan's time.")
    return Figure(_svg(_WIDTH, axis_y + 36, body), alt, caption)


# -- the page -------------------------------------------------------------------------------
_CSS = """
body { font-family: sans-serif; max-width: 940px; margin: 2em auto; color: #222; }
table { border-collapse: collapse; margin: 1em 0; }
td, th { border-bottom: 1px solid #ddd; padding: 3px 12px; text-align: left; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
figure { margin: 2em 0; } figure img { max-width: 100%; }
figcaption { font-size: 0.9em; color: #555; }
.warn { color: #b00; }
"""


def _table(rows: Sequence[Sequence[str]], header: Sequence[str] | None = None, cls: str = "") -> str:
    out = [f"<table class='{cls}'>" if cls else "<table>"]
    if header:
        out.append("<tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in header) + "</tr>")
    for row in rows:
        cells = "".join(f"<td class='num'>{html.escape(c)}</td>" if i else f"<td>{html.escape(c)}</td>"
                        for i, c in enumerate(row))
        out.append(f"<tr>{cells}</tr>")
    out.append("</table>")
    return "".join(out)


def summary_rows(plan: Plan, sim: Simulation) -> list[tuple[str, str]]:
    dp = plan.baselines.get("data")
    rows = [
        ("plan kind", plan.kind),
        ("cluster", f"{plan.cluster.name}: {plan.devices} x {plan.cluster.device.name}"),
        ("predicted iteration", _fmt_time(plan.predicted.iteration_time_s)),
        ("re-simulated iteration", _fmt_time(sim.iteration_time_s)),
        ("speedup over data parallel",
         f"{dp / plan.predicted.iteration_time_s:.2f}x" if dp else "data parallel does not fit"),
        ("lower bound (1 device / N)", _fmt_time(plan.lower_bound_s)),
        ("peak memory per device", f"{fmt_bytes(sim.peak_memory_bytes)} of {fmt_bytes(sim.capacity_bytes)}"),
    ]
    if plan.stages:
        rows.append(("pipeline", f"{len(plan.stages)} stages x {plan.stages[0].replicas} replicas, "
                                 f"{plan.schedule}, {plan.microbatches} microbatches"))
    if plan.topology:
        rows.append(("topology", f"{plan.topology} (spectral gap {plan.spectral_gap:.3g})"
                     if plan.spectral_gap is not None else plan.topology))
    s = plan.search
    budget = f"{s.max_iters} iterations" if s.max_iters is not None else f"{s.budget_s} s"
    rows.append(("search", f"seed {s.seed}, budget {budget}: {s.iterations} MCMC iterations, ILP {s.ilp}"))
    return rows


def render(plan: Plan, sim: Simulation) -> str:
    """The report page for ``plan`` and its re-simulation ``sim`` (module docstring)."""
    title = f"flexsearch plan: {plan.model} on {plan.devices} x {plan.cluster.device.name}"
    figures = [
        timeline_figure(sim),
        memory_figure(sim.memory_bytes, sim.capacity_bytes),
        convergence_figure(plan.search.curve, plan.search.iterations, plan.predicted.iteration_time_s),
        comparison_figure(plan),
    ]
    t = plan.predicted.iteration_time_s
    base_rows = [("this plan", _fmt_time(t), "1.00x")]
    base_rows += [(k, _fmt_time(v), f"{v / t:.2f}x") for k, v in sorted(plan.baselines.items(), key=lambda kv: kv[1])]
    base_rows += [(k, "does not fit in memory", "-") for k in plan.infeasible_baselines]
    base_rows.append(("lower bound", _fmt_time(plan.lower_bound_s), f"{plan.lower_bound_s / t:.2f}x"))
    notes = []
    if not sim.feasible:
        notes.append("<p class='warn'>The re-simulated plan does not fit in memory on this cluster.</p>")
    if abs(sim.iteration_time_s - t) > 1e-6 * t:
        notes.append(f"<p class='warn'>The re-simulation ({_fmt_time(sim.iteration_time_s)}) differs from the "
                     f"plan's prediction ({_fmt_time(t)}): the cost model changed since the plan was made.</p>")
    parts = [
        "<!DOCTYPE html>",
        "<html lang='en'><head><meta charset='utf-8'>",
        f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        _table(summary_rows(plan, sim), cls="summary"),
        *notes,
        "<h2>Timeline</h2>", figures[0].html(),
        "<h2>Memory per device</h2>", figures[1].html(),
        "<h2>Search convergence</h2>", figures[2].html(),
        "<h2>Against the baselines</h2>", figures[3].html(),
        _table(base_rows, header=("plan", "predicted iteration", "vs this plan"), cls="baselines"),
        "<p><small>Written by <code>flexsearch report</code>. Times are the simulator's "
        "predictions for one training iteration.</small></p>",
        "</body></html>",
    ]
    return "\n".join(parts) + "\n"
