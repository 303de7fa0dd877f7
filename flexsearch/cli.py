"""The ``flexsearch`` command line (DESIGN section 2): thin: parse, call, render.

Exit codes: 0 success, 2 bad input (one line on stderr naming the problem and the fix,
no traceback), 1 internal error.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from flexsearch.cli_calibrate import calibrate, warn_calibration
from flexsearch.cli_hardware import cluster, profile
from flexsearch.errors import CalibrationWarning, FlexsearchError
from flexsearch.tables import (
    bench_table,
    ms,
    plan_summary,
    plan_table,
    profile_plan_lines,
    si,
)

try:  # typer >= 0.20 vendors click
    from typer._click.exceptions import ClickException, UsageError
except ImportError:  # pragma: no cover - older typer on top of click
    from click.exceptions import ClickException, UsageError

app = typer.Typer(
    name="flexsearch",
    help="Find the fastest way to train a PyTorch model on many devices.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
stdout = Console(highlight=False)
err = Console(stderr=True, highlight=False)

ModelArg = Annotated[str, typer.Argument(help="Model file: path/to/file.py or path/to/file.py:NAME.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout and nothing else.")]
ProfileOpt = Annotated[str | None, typer.Option(
    "--profile", help="Op times measured by `flexsearch profile` on a device of the cluster's kind: they replace the "
                      "roofline for the ops and shapes the file holds.", show_default=False)]


@app.callback()
def _root() -> None:
    """flexsearch: plan, simulate and emit parallel training for PyTorch models."""


@app.command()
def trace(model: ModelArg, as_json: JsonOpt = False, top: Annotated[int, typer.Option(help="Rows in the table of heaviest ops.", min=1)] = 10) -> None:
    """Trace MODEL into an operator graph: node count, parameters, FLOPs, heaviest ops."""
    from flexsearch.graph import trace as trace_graph
    from flexsearch.model_files import load_model

    module, inputs = load_model(model)
    graph = trace_graph(module, inputs, name=model)
    summary = {
        "model": model,
        "via": graph.via,
        "nodes": len(graph.nodes),
        "num_params": graph.num_params,
        "flops": graph.flops,
        "backward_flops": graph.backward_flops,
        "blocks": [{"module_type": b.module_type, "copies": len(b.instances)} for b in graph.blocks],
        "opaque": [n.name for n in graph.opaque_nodes],
        "fingerprint": graph.fingerprint,
    }
    if as_json:
        summary["graph"] = json.loads(graph.to_json())
        sys.stdout.write(json.dumps(summary) + "\n")
        return
    stdout.print(
        f"[bold]{model}[/] traced via {graph.via}: {len(graph.nodes)} nodes, "
        f"{si(graph.num_params)} parameters, {si(graph.flops, 'FLOP')} forward, "
        f"{si(graph.backward_flops, 'FLOP')} backward per iteration"
    )
    for b in graph.blocks:
        stdout.print(f"repeated block: {len(b.instances)} x {b.module_type} ({len(b.instances[0])} ops each)")
    if graph.opaque_nodes:
        names = ", ".join(f"{n.name} ({n.target})" for n in graph.opaque_nodes[:8])
        stdout.print(f"[yellow]opaque ops (costed, never split): {names}[/]")
    table = Table(title=f"heaviest {top} ops by forward FLOPs")
    for col in ("op", "kind", "target", "output", "fwd FLOPs", "params", "SOAP dims"):
        table.add_column(col, justify="right" if col in ("fwd FLOPs", "params") else "left")
    heavy = sorted(graph.nodes, key=lambda n: (n.flops, n.bytes_read), reverse=True)[:top]
    for n in heavy:
        dims = " ".join(f"{d.kind[0]}{d.dim}" for d in n.dims.output)
        dims += "".join(f" r:{r.name}" for r in n.dims.reduced)
        shape = "x".join(map(str, n.outputs[0].shape)) if n.outputs else ""
        table.add_row(n.name, n.kind, n.target.rsplit(".", 1)[-1], shape, si(n.flops), si(n.num_params), dims or "-")
    stdout.print(table)


app.command()(profile)
app.command()(cluster)
app.command()(calibrate)


def _refuse_overwrite(path: str | None, force: bool, flag: str) -> None:
    """FlexsearchError unless ``path`` (None: not given) can be written: not a directory,
    not an existing file without ``--force``, in a directory that exists, and writable
    (a new file is created and removed to find out, before any work)."""
    if path is None:
        return
    target = Path(path)
    if target.is_dir():
        raise FlexsearchError(f"{flag} {path} is a directory; give the path of a file to write (in it, or elsewhere)")
    if target.exists() and not force:
        raise FlexsearchError(f"{path} exists; pass --force to overwrite it or choose another {flag} path")
    parent = next((p for p in target.parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise FlexsearchError(f"{flag} {path}: {parent} is a file, not a directory; choose another {flag} path")
    if not target.parent.is_dir():
        raise FlexsearchError(f"{flag} {path}: directory {target.parent} does not exist; create it first")
    try:
        if target.exists():
            with target.open("r+b"):  # opened for writing, nothing written
                pass
        else:
            target.touch(exist_ok=False)
            target.unlink()
    except OSError as e:
        raise FlexsearchError(f"cannot write {flag} {path}: {e.strerror or e}; choose a writable path") from None


def _write(path: str, flag: str, write: Callable[[], object]) -> None:
    """``write()`` (which writes ``path``), a failure (a full disk, a path that became
    unwritable) as one line."""
    try:
        write()
    except OSError as e:
        raise FlexsearchError(f"cannot write {flag} {path}: {e.strerror or e}; nothing else was lost, run the "
                              "command again with a writable path") from None


def _refuse_same_file(*paths: tuple[str | None, str]) -> None:
    """FlexsearchError when two of ``paths`` (``(path, what)`` pairs, None: not given)
    name the same file: writing one would overwrite the other."""
    seen: dict[Path, str] = {}
    for path, what in paths:
        if path is None:
            continue
        key = Path(path).resolve()
        if key in seen:
            raise FlexsearchError(f"{seen[key]} and {what} are the same file {path}: one would overwrite the "
                                  "other; give each its own path")
        seen[key] = what


@app.command()
def plan(
    model: ModelArg,
    devices: Annotated[int, typer.Option(help="Number of devices.", min=1)] = 8,
    cluster: Annotated[str | None, typer.Option(help="Cluster preset name or cluster JSON file \\[default: dgx-h100].", show_default=False)] = None,
    budget: Annotated[float | None, typer.Option(help="Time budget in seconds from the command's start, tracing included: when it runs out "
                                                     "the best plan found so far is returned.", min=0.001)] = None,
    max_iters: Annotated[int | None, typer.Option(help="Search budget in MCMC steps (reproducible).", min=0)] = None,
    seed: Annotated[int, typer.Option(help="Random seed of the search.")] = 0,
    objective: Annotated[str, typer.Option(help="time_to_accuracy (iteration time x iterations needed relative to "
                                                "synchronous SGD) or iteration (iteration time alone).")] = "time_to_accuracy",
    decentralized: Annotated[bool, typer.Option(help="Consider D-PSGD plans (each device its own model, gossip "
                                                     "averaging); --no-decentralized keeps synchronous SGD.")] = True,
    precision: Annotated[str, typer.Option(help="Training precision: auto, fp32, tf32, bf16-mixed, fp16-mixed or bf16 "
                                                "(auto: bf16-mixed on devices with fast bf16 matmuls: bf16 tensor "
                                                "cores, a CPU's AVX512-BF16 or AMX; else fp32).")] = "auto",
    batch_norm: Annotated[str, typer.Option("--batch-norm", help="BatchNorm statistics: local (per replica, as DDP) "
                                                                 "or sync (SyncBatchNorm over the replicas; GPUs only, "
                                                                 "not the cpu cluster).")] = "local",
    kind: Annotated[list[str] | None, typer.Option("--kind", help="Only plans of this kind: data, fsdp, soap, pipeline, "
                                                                 "hybrid or decentralized (repeat or separate by commas "
                                                                 "for several).", show_default=False)] = None,
    out: Annotated[str | None, typer.Option(help="Write the plan JSON here.")] = None,
    trace_out: Annotated[str | None, typer.Option("--trace", help="Write the plan's timeline (Chrome trace JSON) here.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite --out / --trace files that exist.")] = False,
    workers: Annotated[int | None, typer.Option(help="Processes the trace and the search may use \\[default: this machine's CPUs]; "
                                                     "the plan does not depend on it.", min=1, show_default=False)] = None,
    profile: ProfileOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Search parallelization plans for MODEL and print the fastest that fits.

    Ctrl-C during the search returns the best plan found so far."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from flexsearch.api import (
        DEFAULT_CLUSTER,
        is_cpu_cluster,
        load_measured,
        measured_note,
        resolve_calibration,
        resolve_cluster,
        resolve_convergence,
        resolve_precision,
        simulate,
        with_note,
        with_precision_note,
    )
    from flexsearch.graph import trace as trace_graph
    from flexsearch.model_files import load_model, split_spec
    from flexsearch.search.planner import DEFAULT_MAX_ITERS, check_kinds, plan_graph

    if objective not in ("iteration", "time_to_accuracy"):
        raise typer.BadParameter("use iteration or time_to_accuracy", param_hint="--objective")
    if batch_norm not in ("local", "sync"):
        raise typer.BadParameter("use local or sync", param_hint="--batch-norm")
    try:
        kinds = check_kinds([k.strip() for item in kind for k in item.split(",") if k.strip()] if kind else None)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--kind") from None
    if kind and "decentralized" in kinds and not decentralized:
        raise typer.BadParameter("--kind decentralized asks for D-PSGD plans and --no-decentralized rules them "
                                 "out; drop one of the two", param_hint="--kind")
    _refuse_same_file((str(split_spec(model)[0]), "the model file"), (out, "--out"), (trace_out, "--trace"))
    _refuse_overwrite(out, force, "--out")
    _refuse_overwrite(trace_out, force, "--trace")
    cl = resolve_cluster(cluster if cluster is not None else DEFAULT_CLUSTER, devices)
    if batch_norm == "sync" and is_cpu_cluster(cl):
        raise typer.BadParameter(f"SyncBatchNorm runs on GPUs only, and the {cl.name} cluster's devices are CPU "
                                 "processes; use --batch-norm local", param_hint="--batch-norm")
    prec, why = resolve_precision(precision, cl)
    from flexsearch.graph.pipedream_profile import is_profile_file

    if is_profile_file(model):
        if out is not None or trace_out is not None or kind:
            raise typer.BadParameter("a PipeDream profile plans a PipeDream baseline; it has no plan file, "
                                     "timeline or kind, drop --out/--trace/--kind", param_hint="MODEL")
        if profile is not None:
            raise typer.BadParameter("a PipeDream profile holds its own layer times; drop --profile",
                                     param_hint="--profile")
        _plan_profile(model, cl, as_json)
        return
    measured = load_measured(profile, cl) if profile is not None else None
    module, inputs = load_model(model)
    total = max_iters if max_iters is not None else (None if budget is not None else DEFAULT_MAX_ITERS)
    of = f"/{total}" if total is not None else ""
    with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), console=err, transient=True, disable=not err.is_terminal) as bar:
        task = bar.add_task("tracing", total=None)
        started = time.perf_counter()
        graph = trace_graph(module, inputs, name=model, precision=prec, workers=workers)
        priced = measured_note(graph, measured, cl, f"profile {profile}") if measured is not None else None
        given = budget
        if budget is not None:  # the budget bounds the whole command: start-up, loading and tracing included
            origin = min(started, _command_started) if _command_started is not None else started
            budget = max(1e-3, budget - (time.perf_counter() - origin))
        bar.update(task, description="searching: baselines and ILP seed", total=total, completed=0)

        def progress(it: int, best: float) -> None:
            found = f"best {ms(best)}" if best < float("inf") else "nothing fits yet"
            bar.update(task, completed=it, description=f"searching: step {it}{of}, {found}")

        calibration = resolve_calibration("auto", cl)
        warn_calibration(cl)
        p = plan_graph(graph, cl, kinds=kinds, budget_s=budget, stated_budget_s=given, max_iters=max_iters, seed=seed, objective=objective,
                       progress=progress, decentralized=decentralized, calibration=calibration,
                       batch_norm=batch_norm, convergence=resolve_convergence(graph.family), workers=workers,
                       measured=measured)
    if priced is not None:
        p = with_note(p, priced)
    p = with_precision_note(p, why)
    if p.interrupted:
        err.print(f"interrupted: returning the best plan found so far ({p.search.iterations} MCMC steps; "
                  "the remaining searches were skipped)", markup=False, soft_wrap=True)
    timeline = simulate(graph, p, calibration=calibration, measured=measured) if trace_out is not None else None
    if out is not None:
        _write(out, "--out", lambda: p.save(out))
    if timeline is not None:
        _write(trace_out, "--trace", lambda: timeline.to_chrome_trace(trace_out))
    if as_json:
        sys.stdout.write(json.dumps(plan_summary(p, p.search_time_s)) + "\n")
        return
    stdout.print(plan_table(p, p.search_time_s, default_cluster=cluster is None))
    if out is not None:
        stdout.print(f"plan written to {out}")
    if trace_out is not None:
        stdout.print(f"timeline written to {trace_out} (open in https://ui.perfetto.dev)")


def _plan_profile(path: str, cl, as_json: bool) -> None:
    """``flexsearch plan graph.txt``: PipeDream's partitioner on measured per-layer costs."""
    from flexsearch.graph.pipedream_profile import load_profile
    from flexsearch.search.pipedream import plan_profile
    from flexsearch.sim.context import CostContext

    profile = load_profile(path)
    order = profile.topological_order()
    best, data = plan_profile(profile, CostContext(cl))  # the profile's own times: nothing to calibrate
    t, dp = best.simulation.iteration_time_s, data.iteration_time_s
    stages = [{"first": order[a], "last": order[b - 1], "layers": b - a, "replicas": len(devs),
               "devices": list(devs)} for a, b, devs in best.stages]
    config = "-".join(str(s["replicas"]) for s in stages)
    if as_json:
        sys.stdout.write(json.dumps({
            "kind": "pipeline", "schedule": "pipedream", "devices": cl.devices, "cluster": cl.name,
            "configuration": config, "stages": stages, "time_per_minibatch_s": t,
            "data_parallel_time_per_minibatch_s": dp, "peak_memory_bytes": best.simulation.peak_memory_bytes,
        }) + "\n")
        return
    for line in profile_plan_lines(path, cl, stages, config, t, dp, best.simulation.peak_memory_bytes):
        stdout.print(line)


def _plan_graph_for(p, plan_path: str):
    """Re-trace the model a plan names (as given, else relative to the plan file)."""
    from flexsearch.graph import trace as trace_graph
    from flexsearch.model_files import load_model, split_spec

    spec = p.model
    path, name = split_spec(spec)
    if not Path(path).exists():
        alt = Path(plan_path).parent / path
        if not alt.exists():
            raise FlexsearchError(f"the plan's model file {path} (as given to `flexsearch plan`) is neither here nor "
                                  f"next to {plan_path}; run this where the plan was made, or plan the model again")
        spec = f"{alt}:{name}" if name else str(alt)
    module, inputs = load_model(spec)
    return trace_graph(module, inputs, name=p.model, precision=p.precision)


@app.command()
def simulate(
    plan_file: Annotated[str, typer.Argument(metavar="PLAN.json", help="A plan written by `flexsearch plan --out`.")],
    trace_out: Annotated[str | None, typer.Option("--trace", help="Write the timeline (Chrome trace JSON) here.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite the --trace file if it exists.")] = False,
    profile: ProfileOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Re-predict a saved plan on the cluster it embeds (re-traces its model file)."""
    from flexsearch.api import MEASURED_NOTE, load_measured
    from flexsearch.api import simulate as simulate_plan
    from flexsearch.cost.hardware import Cluster
    from flexsearch.plan import Plan

    _refuse_same_file((plan_file, "PLAN.json"), (trace_out, "--trace"))
    _refuse_overwrite(trace_out, force, "--trace")
    p = Plan.load(plan_file)
    cl = Cluster.from_spec(p.cluster, p.devices)
    measured = load_measured(profile, cl) if profile is not None else None
    graph = _plan_graph_for(p, plan_file)
    warn_calibration(cl)
    planned = next((n for n in p.notes if n.startswith(MEASURED_NOTE)), None)
    if planned is not None and profile is None:
        err.print(f"note: the plan was priced with measured op times ({planned}); pass --profile to re-predict it "
                  "as planned", markup=False, soft_wrap=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CalibrationWarning)  # said above, in one line
        sim = simulate_plan(graph, p, measured=measured)
    if trace_out is not None:
        _write(trace_out, "--trace", lambda: sim.to_chrome_trace(trace_out))
    summary = {
        "model": p.model,
        "kind": p.kind,
        "devices": p.devices,
        "iteration_time_s": sim.iteration_time_s,
        "peak_memory_bytes": sim.peak_memory_bytes,
        "memory_bytes": list(sim.memory_bytes),
        "feasible": sim.feasible,
        "critical_path_s": sim.critical_path_s,
        "planned_iteration_time_s": p.predicted.iteration_time_s,
    }
    if as_json:
        sys.stdout.write(json.dumps(summary) + "\n")
        return
    stdout.print(
        f"{p.model}: {p.kind} plan on {p.devices} x {p.cluster.device.name}: iteration "
        f"{ms(sim.iteration_time_s)} (planned {ms(p.predicted.iteration_time_s)}), critical path "
        f"{ms(sim.critical_path_s)}, peak memory {si(sim.peak_memory_bytes, 'B')} "
        f"of {si(sim.capacity_bytes, 'B')}{'' if sim.feasible else ' (DOES NOT FIT)'}"
    )
    if trace_out is not None:
        stdout.print(f"timeline written to {trace_out}")


@app.command()
def verify(
    model: ModelArg,
    plan_file: Annotated[str, typer.Option("--plan", metavar="PLAN.json", help="The plan to check (made for MODEL).")],
    ranks: Annotated[int | None, typer.Option(help="Local gloo processes \\[default: the plan's devices].", min=1,
                                              show_default=False)] = None,
    steps: Annotated[int, typer.Option(help="Optimizer steps compared after the first.", min=1)] = 3,
    timeout: Annotated[float, typer.Option(help="Seconds before the ranks count as hung.", min=1)] = 600,
    as_json: JsonOpt = False,
) -> None:
    """Run the emitted plan on local gloo processes against the single-process model:
    loss, every gradient, and the parameters after the steps (exit 0: they match within
    the precision's tolerance; 1: they differ; 2: bad input)."""
    from flexsearch.emit.launch import RanksFailed, run_ranks
    from flexsearch.emit.verify import verify_job
    from flexsearch.model_files import load_model
    from flexsearch.plan import Plan

    p = Plan.load(plan_file)
    n = ranks or p.devices
    if n != p.devices:
        raise FlexsearchError(f"the plan is for {p.devices} devices, not {n}: use --ranks {p.devices}")
    # a model file that does not load, or a plan made for another model, is bad input, before any rank starts
    from flexsearch.graph.tracer import trace as trace_model

    p.strategy(trace_model(*load_model(model), name=model, precision=p.precision))  # checks it fits the graph
    try:
        results = run_ranks(verify_job, n, model, p.model_dump_json(), steps, timeout_s=timeout)
    except RanksFailed as e:
        # a rank that found a mismatch finished: the others' errors follow from it
        bad = next((r for _, r in sorted(e.results.items()) if not r["ok"]), None)
        if bad is None:
            err.print(f"the emitted plan failed: {e.cause}", markup=False, soft_wrap=True)
            raise typer.Exit(1) from None
        results = [e.results.get(r) or {"ok": False, "error": f"failed after another rank's mismatch: "
                                                               f"{e.causes.get(r, 'no result')}"} for r in range(n)]
    else:
        bad = next((r for r in results if not r["ok"]), None)
    if as_json:
        print(json.dumps({"ok": bad is None, "ranks": results}))
    elif bad is not None:
        err.print(f"differs: {bad['error']}", markup=False, soft_wrap=True)
    else:
        r0 = results[0]
        stdout.print(f"matches on {n} ranks ({p.kind}, {p.precision}, {steps} steps, "
                  f"{'the model' + chr(39) + 's own loss' if r0['own_loss'] else 'MSE against a fixed random target'}): "
                  f"loss {r0['loss']:.6g} vs {r0['reference_loss']:.6g}", soft_wrap=True)
        for errv, what in r0["largest"]:
            stdout.print(f"  {what}: relative difference {errv:.2g}", markup=False, soft_wrap=True)
    if bad is not None:
        raise typer.Exit(1)


@app.command()
def show(plan_file: Annotated[str, typer.Argument(metavar="PLAN.json", help="A plan file.")]) -> None:
    """Print a saved plan: summary and each decision's configuration."""
    from flexsearch.plan import Plan

    p = Plan.load(plan_file)
    stdout.print(plan_table(p, None))
    if not p.decisions:
        return
    table = Table(title="decisions (s: sample split, p/a/r: parameter/attribute/reduce split of degree t on dim, x: replicated, @: first device)")
    table.add_column("op")
    table.add_column("configuration")
    for name, cfg in p.decisions.items():
        table.add_row(name, cfg)
    stdout.print(table)


@app.command()
def report(
    plan_file: Annotated[str, typer.Argument(metavar="PLAN.json", help="A plan written by `flexsearch plan --out`.")],
    out: Annotated[str, typer.Option(help="Write the HTML page here.")],
    force: Annotated[bool, typer.Option("--force", help="Overwrite the --out file if it exists.")] = False,
) -> None:
    """Write a self-contained HTML report about a saved plan.

    The page shows the simulated timeline, memory per device against capacity, the
    search's convergence and the plan against its baselines and lower bound (the plan's
    model file is traced again)."""
    from flexsearch.api import simulate as simulate_plan
    from flexsearch.cost.hardware import Cluster
    from flexsearch.plan import Plan
    from flexsearch.report import render

    _refuse_same_file((plan_file, "PLAN.json"), (out, "--out"))
    _refuse_overwrite(out, force, "--out")
    p = Plan.load(plan_file)
    graph = _plan_graph_for(p, plan_file)
    warn_calibration(Cluster.from_spec(p.cluster, p.devices))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CalibrationWarning)  # said above, in one line
        page = render(p, simulate_plan(graph, p))
    _write(out, "--out", lambda: Path(out).write_text(page, encoding="utf-8"))
    stdout.print(f"report written to {out}")


def _rel(path: Path) -> str:
    """``path`` relative to the working directory when it is under it."""
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


@app.command()
def bench(
    check: Annotated[bool, typer.Option("--check", help="Exit 1 when a plan got more than 1% slower, became infeasible, or is not in the baseline.")] = False,
    update: Annotated[bool, typer.Option("--update", help="Rewrite the baseline with this run's results.")] = False,
    baseline: Annotated[str | None, typer.Option(help="Baseline file \\[default: benchmarks/baseline.json].", show_default=False)] = None,
) -> None:
    """Check predicted plan costs against the recorded baseline.

    Plans a fixed matrix of zoo models x clusters x device counts (fixed seed and
    budget: deterministic) and compares each predicted iteration time with the baseline
    file."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from flexsearch import bench as b

    if check and update:
        raise typer.BadParameter("--check compares with the baseline, --update rewrites it: pass one", param_hint="--update")
    path = b.BASELINE_PATH if baseline is None else Path(baseline)
    if check and not path.exists():
        raise FlexsearchError(f"no baseline at {path}; record one with `flexsearch bench --update`")
    with Progress(TextColumn("bench"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.description}"), console=err, transient=True, disable=not err.is_terminal) as bar:
        task = bar.add_task("", total=None)

        def progress(done: int, total: int, case) -> None:
            bar.update(task, completed=done, total=total, description=f"{case.name} on {case.devices} x {case.cluster}")

        run = b.bench(baseline_path=path, progress=progress)
    cmp = run.comparison
    for x in bench_table(run, _rel(path)):
        stdout.print(x, markup=False)
    if update:
        b.write_baseline(run.baseline(), path)
        stdout.print(f"baseline written to {_rel(path)} ({len(run.results)} plans)")
    stdout.print(f"cases={len(cmp.rows)} regressed={cmp.count('regressed')} improved={cmp.count('improved')} "
                 f"new={cmp.count('new')} infeasible={sum(r.iteration_time_s is None for r in run.results)} "
                 f"seconds={run.seconds:.1f}", markup=False)
    if check and cmp.failed:
        why = cmp.stale or ", ".join(f"{r.label} {r.status}" for r in cmp.rows if r.status in b.FAILING)
        err.print(f"bench --check failed: {why}; fix the regression, or record the change on purpose "
                  "with `flexsearch bench --update`", markup=False, soft_wrap=True)
        raise typer.Exit(1)


def main(argv: list[str] | None = None) -> int:
    """Entry point: run the app; user errors become one line on stderr and exit code 2,
    Ctrl-C outside a search exit code 130. Returns the exit code."""
    try:
        # Without standalone mode the app returns a command's typer.Exit code (and 130
        # for a KeyboardInterrupt) instead of exiting.
        code = app(args=argv, prog_name="flexsearch", standalone_mode=False)
    except FlexsearchError as exc:
        err.print(f"error: {exc}", markup=False, soft_wrap=True)
        return 2
    except (typer.Abort, KeyboardInterrupt):
        code = 130
    except UsageError as exc:
        ctx = getattr(exc, "ctx", None)
        cmd = ctx.command_path if ctx is not None else "flexsearch"
        err.print(f"error: {exc.format_message()} (see `{cmd} --help`)", markup=False, soft_wrap=True)
        return 2
    except ClickException as exc:
        err.print(f"error: {exc.format_message()}", markup=False, soft_wrap=True)
        return 2
    except typer.Exit as exc:
        code = exc.exit_code
    code = code if isinstance(code, int) else 0
    if code == 130:
        err.print("interrupted", soft_wrap=True)
    return code


def _process_age_s() -> float:
    """Seconds since this process started (Linux: from ``/proc``; else 0), so that a
    budget counts the interpreter's start and the imports too."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


_command_started: float | None = None
"""When the ``flexsearch`` process started (``time.perf_counter()``; set by
:func:`entry`, so ``main`` called in another program counts from its loading)."""


def entry() -> None:
    """The ``flexsearch`` command: :func:`main`, its budget counted from the process's
    start, then out without the interpreter's teardown. Every output is written and
    flushed and every worker joined by then; what is left is freeing torch's and the
    search's objects, 0.7 s after loading a model and 1.3 s after planning GPT-2 XL on
    this host (``os._exit`` against a normal exit), time a ``--budget`` would otherwise
    pay for nothing."""
    global _command_started
    _command_started = time.perf_counter() - _process_age_s()
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    entry()
