"""``flexsearch profile`` and ``flexsearch cluster``: measuring this device's ops and
links, and showing a cluster with the source of every number. :mod:`flexsearch.cli`
registers the commands and imports this module, so the functions import its consoles
when they run."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from flexsearch.errors import FlexsearchError
from flexsearch.tables import si


def profile(
    model: Annotated[str | None, typer.Argument(help="Model file: path/to/file.py[:NAME]. Optional with --comm.")] = None,
    out: Annotated[str | None, typer.Option(help="Profile file (default profiles/<device>.json); measured entries are added to it.")] = None,
    threads: Annotated[int, typer.Option(help="CPU threads per process while measuring.", min=1)] = 1,
    repeats: Annotated[int, typer.Option(help="Timed runs per op (the median is kept).", min=1)] = 5,
    warmup: Annotated[int, typer.Option(help="Untimed runs per op before timing.", min=0)] = 2,
    comm: Annotated[bool, typer.Option("--comm", help="Measure this machine's gloo links and compute peak; rewrite the cpu preset.")] = False,
    ranks: Annotated[int, typer.Option(help="gloo processes for --comm.", min=2)] = 2,
    precision: Annotated[str, typer.Option(help="Precision the ops run in: fp32, tf32, bf16-mixed, fp16-mixed or bf16 "
                                                "(a plan looks up its own precision's times).")] = "fp32",
) -> None:
    """Measure each op's forward and backward time on this device.

    Full and partitioned shapes, cached in profiles/<device>.json (an existing --out file
    is added to, never overwritten); with --comm, measure this machine's gloo links."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from flexsearch.cli import err, stdout

    if model is None and not comm:
        raise typer.BadParameter("give a MODEL to profile, or --comm to measure the links", param_hint="MODEL")
    if out is not None and Path(out).is_dir():
        raise FlexsearchError(f"--out {out} is a directory; give the path of a profile file (in it, or elsewhere)")
    from flexsearch.precision import NAMES

    if precision not in NAMES:
        raise typer.BadParameter(f"unknown precision {precision!r}; use one of {', '.join(NAMES)}",
                                 param_hint="--precision")
    if comm:
        from flexsearch.cost.cpu_preset import profile_machine

        summary = profile_machine(world_size=ranks, threads_per_rank=threads, write=True, progress=lambda m: err.print(m, markup=False))
        stdout.print(" ".join(f"{k}={v}" for k, v in summary.items()))
    if model is None:
        return
    from flexsearch.cost.profiler import profile_model
    from flexsearch.model_files import load_model

    module, inputs = load_model(model)
    with Progress(
        TextColumn("profiling"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        TextColumn("{task.description}"), console=err, transient=True, disable=not err.is_terminal,
    ) as bar:  # fmt: skip
        task = bar.add_task("tracing", total=None)

        def report(done: int, total: int, what: str) -> None:
            bar.update(task, completed=done, total=total, description=what)

        db, counts = profile_model(module, inputs, out=out, threads=threads, repeats=repeats, warmup=warmup,
                                   progress=report, precision=precision)
    stdout.print(
        f"{db.path}: {counts['measured']} measured, {counts['cached']} already cached, "
        f"{counts['skipped']} skipped; {len(db)} entries for {db.data.device}"
    )


def cluster(
    name: Annotated[str | None, typer.Argument(help="Preset name or cluster JSON file; omit to list the presets.")] = None,
    devices: Annotated[int | None, typer.Option(help="Devices to take (as many nodes as needed).", min=1)] = None,
) -> None:
    """Show a cluster (device, links, each number's source), or list the presets."""
    from flexsearch.cli import stdout
    from flexsearch.cost.hardware import Cluster

    if name is None:
        for preset in Cluster.available_presets():
            c = Cluster.preset(preset)
            stdout.print(f"{preset:<14} {c.device.name:<26} {c.devices_per_node} per node  {c.spec.description}", soft_wrap=True)
        return
    c = Cluster.resolve(name, devices)
    spec = c.spec
    table = Table(title=f"{spec.name}: {c.devices} devices on {c.num_nodes} node(s)")
    for col in ("what", "value", "source"):
        table.add_column(col)
    rows = [
        ("device", spec.device.name, ""),
        ("peak float32", si(spec.device.peak_flops.float32.value, "FLOP/s"), spec.device.peak_flops.float32.source),
        ("peak bfloat16", si(spec.device.peak_flops.bfloat16.value, "FLOP/s"), spec.device.peak_flops.bfloat16.source),
        ("memory bandwidth", si(spec.device.memory_bandwidth.value, "B/s"), spec.device.memory_bandwidth.source),
        ("memory", si(spec.device.memory_capacity.value, "B"), spec.device.memory_capacity.source),
        (f"intra-node {spec.intra_node.kind} ({spec.intra_node.topology})", si(spec.intra_node.bandwidth.value, "B/s"), spec.intra_node.bandwidth.source),
        ("intra-node latency", f"{spec.intra_node.latency.value * 1e6:.1f} us", spec.intra_node.latency.source),
    ]
    if spec.inter_node is not None:
        inter = spec.inter_node
        rows += [
            (f"inter-node {inter.kind} per NIC", si(inter.bandwidth.value, "B/s"), inter.bandwidth.source),
            ("inter-node latency", f"{inter.latency.value * 1e6:.1f} us", inter.latency.source),
            ("NICs per node", str(inter.nics_per_node.value), inter.nics_per_node.source),
        ]
    for row in rows:
        table.add_row(*row)
    stdout.print(table)
