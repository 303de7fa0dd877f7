"""What the CLI prints about a plan: the table and the ``--json`` summary (DESIGN section 2)."""

from __future__ import annotations

from rich.table import Table


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
        "search_time_s": search_time_s,
        "interrupted": p.interrupted,
        "objective": p.objective,
        "precision": p.precision,
        "model_flops": p.model_flops,
        "mfu": p.mfu,
        "topology": p.topology,
        "spectral_gap": p.spectral_gap,
        "iterations_factor": p.iterations_factor,
        "notes": list(p.notes),
    }


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


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
        chunks = f", {p.chunks} chunks per rank" if (p.chunks or 1) > 1 else ""
        recompute = f", {p.recompute} activation recomputation" if p.recompute != "none" else ""
        rows.append(("schedule", f"{p.schedule}, {p.microbatches} microbatches{chunks}{recompute}"))
        shape = f"{len(p.stages) // (p.chunks or 1)} x {p.stages[0].replicas} x {p.tensor_degree}"
        rows.append(("stages x replicas x tensor", shape))
        for i, st in enumerate(p.stages):
            rows.append((f"stage {i}", f"{st.nodes[0]} .. {st.nodes[-1]} ({len(st.nodes)} ops) on devices "
                         f"{st.devices[0]}-{st.devices[-1]}"))
    if not p.stages and (p.recompute != "none" or (p.microbatches or 1) > 1):
        rows.append(("training", f"{p.microbatches or 1} microbatches accumulated, {p.recompute} activation "
                                 "recomputation"))
    if p.kind == "decentralized":
        gap = "" if p.spectral_gap is None else f", spectral gap {p.spectral_gap:.4f}"
        rows.append(("topology", f"{p.topology}{gap}"))
        if p.iterations_factor is not None:
            rows.append(("iterations to same accuracy", f"{p.iterations_factor:.2f}x synchronous SGD's "
                                                        f"(objective: {p.objective})"))
    for name, t in sorted(p.baselines.items()):
        rows.append((f"baseline {name}", ms(t)))
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
