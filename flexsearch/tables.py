"""What the CLI prints: a plan's table and ``--json`` summary (DESIGN section 2), the
``bench`` comparison and a convergence measurement (``calibrate --convergence``)."""

from __future__ import annotations

from rich import box
from rich.table import Table
from rich.text import Text

from flexsearch.plan import REFERENCE_BASELINES


def si(x: float, unit: str = "") -> str:
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {prefix}{unit}"
    return f"{x:.0f} {unit}".rstrip()


def plan_summary(p, search_time_s: float | None) -> dict:
    """The ``--json`` summary of a plan."""
    return {
        "model": p.model,
        "kind": p.kind,
        "devices": p.devices,
        "cluster": p.cluster.name,
        "iteration_time_s": p.predicted.iteration_time_s,
        "peak_memory_bytes": p.predicted.peak_memory_bytes,
        "lower_bound_s": p.lower_bound_s,
        "baselines": p.baselines,
        "infeasible_baselines": list(p.infeasible_baselines),
        "speedup_over_data": p.speedup_over_data,
        "noise": p.noise,
        "within_noise": list(p.within_noise),
        "search_time_s": search_time_s,
        "interrupted": p.interrupted,
        "objective": p.objective,
        "precision": p.precision,
        "shard": p.shard,
        "recompute": p.recompute,
        "model_flops": p.model_flops,
        "mfu": p.mfu,
        "topology": p.topology,
        "spectral_gap": p.spectral_gap,
        "iterations_factor": p.iterations_factor,
        "notes": list(p.notes),
    }


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def microbatches(n: int) -> str:
    """``"1 microbatch"``, ``"4 microbatches"``."""
    return f"{n} microbatch" + ("" if n == 1 else "es")


def schedule(p) -> str:
    """What a pipeline or hybrid plan's schedule runs: with one pipeline stage (every
    chunk on every device) there is no pipelining, the chunks run in turn and the
    microbatches one after another (accumulated)."""
    chunks, m = p.chunks or 1, p.microbatches or 1
    recompute = f", {p.recompute} activation recomputation" if p.recompute != "none" else ""
    if len(p.stages) // chunks == 1:
        parts = f" in {chunks} chunks run in turn" if chunks > 1 else ""
        accumulated = " accumulated" if m > 1 else ""
        return f"no pipelining (one stage{parts}), {microbatches(m)}{accumulated}{recompute}"
    per_rank = f", {chunks} chunks per rank" if chunks > 1 else ""
    return f"{p.schedule}, {microbatches(m)}{per_rank}{recompute}"


def plan_table(p, search_time_s: float | None, *, default_cluster: bool = False) -> Table:
    """The plan as the CLI's table (DESIGN section 2): kind, prediction, baselines, why."""
    table = Table(title=f"{p.model}: {p.devices} x {p.cluster.device.name} ({p.cluster.name})")
    table.add_column("what")
    table.add_column("value", justify="right")
    dp = p.baselines.get("data")
    cluster_note = " (the default; choose with --cluster)" if default_cluster else ""
    rows = [
        ("cluster", f"{p.cluster.name}, {p.devices} x {p.cluster.device.name}{cluster_note}"),
        ("plan kind", p.kind),
        ("precision", p.precision),
        ("predicted iteration", ms(p.predicted.iteration_time_s)),
        ("speedup over data parallel", f"{dp / p.predicted.iteration_time_s:.2f}x" if dp else "data parallel does not fit"),
        ("lower bound (1 device / N)", ms(p.lower_bound_s)),
        ("peak memory per device", si(p.predicted.peak_memory_bytes, "B")),
    ]
    if p.mfu is not None:
        rows.append(("model FLOP/s utilisation", f"{p.mfu:.1%} ({si(p.model_flops, 'FLOP')} per iteration)"))
    if p.stages:
        rows.append(("schedule", schedule(p)))
        shape = f"{len(p.stages) // (p.chunks or 1)} x {p.stages[0].replicas} x {p.tensor_degree}"
        rows.append(("stages x replicas x tensor", shape))
        part = "chunk" if len(p.stages) // (p.chunks or 1) == 1 and len(p.stages) > 1 else "stage"
        for i, st in enumerate(p.stages):
            rows.append((f"{part} {i}", f"{st.nodes[0]} .. {st.nodes[-1]} ({len(st.nodes)} ops) on devices "
                         f"{st.devices[0]}-{st.devices[-1]}"))
    if p.shard != "none":
        group = f", shard groups of {p.shard_group} devices, replicated across groups" if p.shard == "hsdp" else ""
        rows.append(("sharding", f"{p.shard}{group}"))
    if not p.stages and (p.recompute != "none" or (p.microbatches or 1) > 1):
        m = p.microbatches or 1
        rows.append(("training", f"{microbatches(m)}{' accumulated' if m > 1 else ''}, {p.recompute} activation "
                                 "recomputation"))
    if p.kind == "decentralized":
        gap = "" if p.spectral_gap is None else f", spectral gap {p.spectral_gap:.4f}"
        rows.append(("topology", f"{p.topology}{gap}"))
        if p.iterations_factor is not None:
            rows.append(("iterations to same accuracy", f"{p.iterations_factor:.2f}x synchronous SGD's "
                                                        f"(objective: {p.objective})"))
    close = p.within_noise
    for name, t in sorted(p.baselines.items()):
        said = f" (within noise: {p.noise:.1%})" if name in close else ""
        if name in REFERENCE_BASELINES:
            said += f" (for reference: {REFERENCE_BASELINES[name]})"
        rows.append((f"baseline {name}", ms(t) + said))
    for name in p.infeasible_baselines:
        rows.append((f"baseline {name}", "does not fit"))
    if search_time_s is not None:
        stopped = ", interrupted" if p.interrupted else ""
        rows.append(("search time", f"{search_time_s:.1f} s ({p.search.iterations} MCMC steps{stopped}, "
                                    f"ILP {p.search.ilp})"))
    rows += [("why", note) for note in p.notes]
    for row in rows:
        table.add_row(*row)
    return table


STATUS_STYLE = {"regressed": "red", "new": "yellow", "improved": "green"}


def _bench_ms(t: float | None) -> str:
    return f"{t * 1e3:.3f}" if t is not None else "does not fit"


def bench_table(run, baseline_name: str) -> list:
    """``flexsearch bench``'s table of a run against its baseline, then one line per
    improved case."""
    table = Table(title=f"bench: {len(run.results)} plans (seed {run.seed}, {run.max_iters} MCMC steps) vs "
                        f"{baseline_name}",
                  box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1), collapse_padding=True)
    for col in ("model", "cluster", "N", "kind", "ms", "baseline ms", "change", "status"):
        table.add_column(col, justify="right" if col in ("N", "ms", "baseline ms", "change") else "left", no_wrap=True)
    lines = []
    for r in run.comparison.rows:
        now, before = r.now, r.before
        was = "-" if before is None else _bench_ms(before.iteration_time_s)
        change = f"{r.change:+.2%}" if r.change is not None else "-"
        style = STATUS_STYLE.get(r.status, "")
        table.add_row(now.model.rsplit(":", 1)[-1], now.cluster, str(now.devices), now.kind or "-",
                      _bench_ms(now.iteration_time_s), was, change, Text(r.status, style=style))
        if r.status == "improved":
            pct = f" ({r.change:+.2%})" if r.change is not None else ""
            lines.append(f"improved: {r.label}: {_bench_ms(before.iteration_time_s)} -> "
                         f"{_bench_ms(now.iteration_time_s)} ms{pct}")
    return [table, *lines]


def _edge(f) -> str:
    if not f.at_bound:
        return ""
    return "; no slowdown measured" if f.split == "iid" else "; more slowdown than the bound fits"


def convergence_table(data) -> list:
    """A convergence file's measured factors, then one line per fit."""
    table = Table(title=f"D-PSGD convergence of {data.family} (target: all-reduce's loss once at "
                        f"{data.target_fraction:.0%} of its initial loss)")
    for col in ("ranks", "split", "topology", "iterations factor"):
        table.add_column(col, justify="right" if col != "topology" else "left")
    for f in data.factors:
        table.add_row(str(f.ranks), f.split, f.topology, f"{f.factor:.3f}" + (" (not reached)" if f.censored else ""))
    return [table, *(f"{f.split} fit: sigma^2/eps = {f.noise_ratio:.3g}, zeta^2/eps = {f.heterogeneity_ratio:.3g} "
                     f"(rms log error {f.rms_log_error:.3f}{_edge(f)})" for f in data.fits)]


def profile_plan_lines(path: str, cl, stages: list[dict], config: str, t: float, dp: float,
                       peak_bytes: float) -> list:
    """``flexsearch plan graph.txt``'s stage table and summary lines."""
    table = Table(title=f"{path}: PipeDream plan on {cl.devices} x {cl.device.name} ({cl.name})")
    table.add_column("stage")
    table.add_column("layers")
    table.add_column("replicas", justify="right")
    table.add_column("devices")
    for i, s in enumerate(stages):
        table.add_row(str(i), f"{s['first']} .. {s['last']} ({s['layers']})", str(s["replicas"]),
                      f"{s['devices'][0]}-{s['devices'][-1]}" if len(s["devices"]) > 1 else str(s["devices"][0]))
    return [table, f"configuration {config}, asynchronous 1F1B with weight stashing",
            f"predicted time per minibatch {ms(t)}; data parallel {ms(dp)} ({dp / t:.2f}x); "
            f"peak memory per device {si(peak_bytes, 'B')}"]
