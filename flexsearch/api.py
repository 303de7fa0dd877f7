"""The public pipeline: model -> OpGraph -> searches -> Plan, and plan -> Simulation.

:func:`plan` traces the model (fake tensors, no real memory), loads the cluster
(``Cluster.preset(name, devices)`` or a cluster file) and runs the planner
(:mod:`flexsearch.search.planner`). :func:`simulate` re-predicts a saved plan through
the one prediction entry point (:func:`flexsearch.sim.predict.predict`).

Both read this device's calibration (:func:`flexsearch.cost.calibration.load_calibration`:
this machine's file, else the built-in one) unless given one (``calibration=``) or
told not to (``calibration=None``); nothing below them reads it on its own. For this
host's devices (the ``cpu`` preset) they warn (:class:`~flexsearch.errors.CalibrationWarning`,
one line) when the calibration on disk is missing or was measured on another host.
"""

from __future__ import annotations

import numbers
import os
import time
import warnings
from collections.abc import Callable, Iterable
from typing import Literal

import torch
from torch import nn

from flexsearch import precision as precision_mod
from flexsearch.cost.calibration import DeviceCalibration, host_warning, load_calibration
from flexsearch.cost.compute import MeasuredCosts
from flexsearch.cost.hardware import Cluster, user_dir
from flexsearch.errors import (
    CalibrationWarning,
    ClusterSpecError,
    FlexsearchError,
    PlanFileError,
    ProfileError,
)
from flexsearch.graph.opgraph import OpGraph
from flexsearch.graph.tracer import trace
from flexsearch.plan import Plan
from flexsearch.precision import Precision, resolve
from flexsearch.precision import precision as precision_of
from flexsearch.sim.accounting import OPTIMIZER_STATE
from flexsearch.sim.context import CostContext
from flexsearch.sim.predict import predict
from flexsearch.sim.result import Simulation
from flexsearch.strategy.convergence import BUILTIN_DIR, Constants, constants_for

DEFAULT_CLUSTER = "dgx-h100"
MEASURED_NOTE = "op costs:"
"""How the note of a plan priced from measured op times begins (:func:`measured_note`)."""
Calibration = DeviceCalibration | None | Literal["auto"]
"""A calibration, ``None`` for none, or ``"auto"``: this device's from disk."""


def resolve_cluster(cluster: str | os.PathLike[str] | Cluster | None, devices: int) -> Cluster:
    """A :class:`Cluster` of ``devices`` devices from a preset name, a file, or a
    Cluster (default: the ``dgx-h100`` preset)."""
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ClusterSpecError(f"devices must be a positive integer (got {devices!r}); pass e.g. devices=8")
    if isinstance(cluster, Cluster):
        if cluster.devices != devices:
            return Cluster.from_spec(cluster.spec, devices)
        return cluster
    return Cluster.resolve(cluster if cluster is not None else DEFAULT_CLUSTER, devices)


def is_cpu_cluster(cluster: Cluster) -> bool:
    """Are ``cluster``'s devices CPU processes (gloo over shared memory, as the ``cpu``
    preset), not accelerators?"""
    return cluster.spec.intra_node.kind == "shared-memory"


def resolve_calibration(calibration: Calibration, cluster: Cluster) -> DeviceCalibration | None:
    """``calibration``, or for ``"auto"`` the calibration on disk of ``cluster``'s device
    (None when there is none)."""
    if isinstance(calibration, str):
        if calibration != "auto":
            raise FlexsearchError(f"calibration must be 'auto', None or a DeviceCalibration (got {calibration!r})")
        return load_calibration(cluster.device.name)
    return calibration


def calibration_warning(calibration: Calibration, cluster: Cluster) -> str | None:
    """One line when ``"auto"`` finds no calibration of this host's devices, or one
    measured on another host (:func:`flexsearch.cost.calibration.host_warning`). Only
    the ``cpu`` preset's devices are this host's, what ``flexsearch calibrate``
    measures; an accelerator's predictions are uncalibrated by design."""
    if calibration != "auto" or cluster.name != "cpu":
        return None
    from flexsearch.cost.profiler import host_info

    return host_warning(cluster.device.name, load_calibration(cluster.device.name), host_info())


def _warn_calibration(calibration: Calibration, cluster: Cluster) -> None:
    msg = calibration_warning(calibration, cluster)
    if msg is not None:
        warnings.warn(msg, CalibrationWarning, stacklevel=3)


def resolve_convergence(family: str) -> Constants:
    """D-PSGD's iterations-factor constants for models of class ``family``: this
    machine's measurement (``~/.flexsearch/convergence/``, what ``flexsearch calibrate
    --convergence`` writes), else the shipped one, else the default
    (:func:`flexsearch.strategy.convergence.constants_for`)."""
    return constants_for(family, dirs=(user_dir() / "convergence", BUILTIN_DIR))


def plan(
    model: nn.Module,
    example_inputs: tuple,
    *,
    devices: int,
    cluster: str | os.PathLike[str] | Cluster | None = None,
    budget_s: float | None = None,
    max_iters: int | None = None,
    seed: int = 0,
    objective: Literal["iteration", "time_to_accuracy"] = "time_to_accuracy",
    optimizer: Literal["adam", "momentum", "sgd"] = "adam",
    kinds: str | Iterable[str] | None = None,
    precision: str = "auto",
    progress: Callable[[int, float], None] | None = None,
    decentralized: bool = True,
    measured: MeasuredCosts | None = None,
    calibration: Calibration = "auto",
    batch_norm: Literal["local", "sync"] = "local",
    workers: int | None = None,
) -> Plan:
    """Search every plan kind (or those in ``kinds``, :data:`flexsearch.strategy.kinds.KINDS`:
    an iterable of names, or one string of names separated by commas) for ``model`` on
    ``devices`` devices of ``cluster`` and return the fastest that fits in memory.
    Bad arguments are a :class:`~flexsearch.errors.FlexsearchError`, raised before the
    model is traced.

    Budgets: ``max_iters`` (reproducible: same seed, same plan) or ``budget_s``
    (seconds for the whole call, tracing included: every phase checks the clock and the
    best plan found in time comes back, its notes naming the phases cut); neither means
    the default iteration budget. ``objective``
    ``time_to_accuracy`` (default) ranks plans by iteration time x the iterations they
    need relative to synchronous SGD: 1 for every synchronous kind, a D-PSGD plan's
    measured or default factor (:mod:`flexsearch.strategy.convergence`);
    ``iteration`` by iteration time alone.
    ``decentralized=False`` keeps synchronous training: D-PSGD plans are simulated for
    the notes but never returned (``kinds`` naming ``decentralized`` with it is an error).
    ``optimizer``: the one the plan is priced for (state and update), adam, momentum or
    sgd. ``batch_norm="sync"`` (SyncBatchNorm) needs GPUs: an error on a cluster of CPU
    processes (:func:`is_cpu_cluster`). ``measured``: op costs measured by the profiler.
    ``precision`` (:mod:`flexsearch.precision`): ``auto`` is ``bf16-mixed`` on devices
    with fast bf16 matmuls (a GPU's tensor cores, a CPU's AVX512-BF16 or AMX), else
    ``fp32``; the plan's notes say which and why.
    ``workers``: processes the trace and the search may use (default: this machine's CPUs); the plan
    is the same whatever the number."""
    from flexsearch.search.planner import check_kinds, plan_graph

    if objective not in ("iteration", "time_to_accuracy"):
        raise FlexsearchError(f"unknown objective {objective!r}; use 'iteration' or 'time_to_accuracy'")
    if max_iters is not None:
        if isinstance(max_iters, bool) or not isinstance(max_iters, numbers.Integral) or max_iters < 0:
            raise FlexsearchError(f"max_iters must be a whole number >= 0 (got {max_iters!r}); pass e.g. max_iters=200")
        max_iters = int(max_iters)
    if budget_s is not None and (isinstance(budget_s, bool) or not isinstance(budget_s, numbers.Real)
                                 or not budget_s > 0):
        raise FlexsearchError(f"budget_s must be a number of seconds > 0 (got {budget_s!r})")
    if not isinstance(optimizer, str) or optimizer not in OPTIMIZER_STATE:
        raise FlexsearchError(f"unknown optimizer {optimizer!r}; use one of {', '.join(OPTIMIZER_STATE)}")
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise FlexsearchError(f"workers must be a whole number >= 1 (got {workers!r})")
    if isinstance(kinds, str):  # one kind, or several separated by commas (as the CLI's --kind)
        kinds = [k.strip() for k in kinds.split(",") if k.strip()]
    asked = None if kinds is None else tuple(kinds)
    try:
        kinds = check_kinds(asked)
    except ValueError as e:
        raise FlexsearchError(str(e)) from None
    if asked is not None and "decentralized" in asked and not decentralized:
        raise FlexsearchError("kinds asks for decentralized (D-PSGD) plans and decentralized=False rules them out; "
                              "drop one of the two")
    if batch_norm not in ("local", "sync"):
        raise FlexsearchError(f"batch_norm is 'local' (per replica, as DDP) or 'sync' (SyncBatchNorm), "
                              f"not {batch_norm!r}")
    cl = resolve_cluster(cluster, devices)
    if batch_norm == "sync" and is_cpu_cluster(cl):
        raise FlexsearchError(f"SyncBatchNorm runs on GPUs only, and the {cl.name} cluster's devices are CPU "
                              "processes; use batch_norm='local'")
    prec, why = resolve_precision(precision, cl)
    _warn_calibration(calibration, cl)
    t0 = time.perf_counter()
    graph = trace(model, example_inputs, precision=prec, workers=workers)
    priced = measured_note(graph, measured, cl) if measured is not None else None
    given = budget_s
    if budget_s is not None:  # the budget bounds the whole call, tracing included
        budget_s = max(1e-3, budget_s - (time.perf_counter() - t0))
    p = plan_graph(graph, cl, kinds=kinds, budget_s=budget_s, stated_budget_s=given, max_iters=max_iters, seed=seed,
                   optimizer=optimizer, objective=objective, progress=progress, decentralized=decentralized,
                   measured=measured, calibration=resolve_calibration(calibration, cl), batch_norm=batch_norm,
                   convergence=resolve_convergence(graph.family), workers=workers)
    if priced is not None:
        p = with_note(p, priced)
    return with_precision_note(p, why)


def load_measured(path: str | os.PathLike[str], cluster: Cluster) -> MeasuredCosts:
    """The op times of the profile file ``path`` (written by ``flexsearch profile`` on a
    device of ``cluster``'s kind) answering for ``cluster``'s device: the profiler names
    the device it ran on (``cpu-1t``, a CUDA device's name), a cluster file its own.
    A missing or damaged file is a :class:`~flexsearch.errors.ProfileError`."""
    from flexsearch.cost.profiler import ProfileDB

    if not os.path.isfile(path):
        raise ProfileError(f"profile {path} does not exist; measure one with `flexsearch profile MODEL --out {path}` "
                           "on a device of the cluster's kind")
    return ProfileDB.load(path).aliased(cluster.device.name)


def measured_ops(graph: OpGraph, measured: MeasuredCosts, cluster: Cluster) -> tuple[int, int]:
    """How many of ``graph``'s priced ops (those the profiler measures: not inputs,
    parameters or the output, not ops that read and compute nothing) the ``measured`` costs hold at the dtype the graph's precision prices them at, whole
    (the profiler's key or its microbatch and split estimates), of how many."""
    from flexsearch.cost.compute import FREE_KINDS, Partition, op_cost

    ctx = CostContext(cluster, measured, precision=precision_of(graph.precision))
    priced = [n for n in graph.nodes if n.kind not in FREE_KINDS and (n.bytes_read or n.flops)]
    hits = sum(op_cost(n, cluster.device, Partition(), dtype=ctx.compute_dtype(n), measured=measured).source
               == "measured" for n in priced)
    return hits, len(priced)


def measured_note(graph: OpGraph, measured: MeasuredCosts, cluster: Cluster, source: str = "the profile given") -> str:
    """A plan note saying how many of its ops are priced from measured times
    (:func:`measured_ops`), the rest by the roofline. None of them is a
    :class:`~flexsearch.errors.ProfileError`: measured costs were asked for, and a plan
    priced without them would be silently other than asked (another model's profile,
    another precision or torch version)."""
    hits, total = measured_ops(graph, measured, cluster)
    if total and not hits:
        fix = f"measure them with `flexsearch profile MODEL --precision {graph.precision}`, or plan at the profile's"
        raise ProfileError(f"{source} holds none of this model's {total} ops at {graph.precision} on torch "
                           f"{torch.__version__}; {fix}")
    rest = ", the others by the roofline" if hits < total else ""
    return f"{MEASURED_NOTE} {hits} of {total} ops measured ({source}){rest}"


def with_note(plan: Plan, note: str, *, first: bool = False) -> Plan:
    """``plan`` with ``note`` added last (``first``: first), its search time kept."""
    out = plan.model_copy(update={"notes": (note, *plan.notes) if first else (*plan.notes, note)})
    return out.with_search_time(plan.search_time_s) if plan.search_time_s is not None else out


def resolve_precision(name: str, cluster: Cluster) -> tuple[Precision, str]:
    """``(precision, why)`` for ``name`` (``auto`` or a precision's name) on ``cluster``'s
    device (:func:`flexsearch.precision.resolve`, which words the reason for a CPU's
    devices as a CPU's: :func:`is_cpu_cluster`); an unknown name is a FlexsearchError."""
    try:
        prec, why = resolve(name, cluster.device, cpu=is_cpu_cluster(cluster))
    except ValueError as e:
        raise FlexsearchError(str(e)) from None
    if name == "auto" and prec.autocast == "bfloat16" and cluster.name == "cpu" and not precision_mod.host_runs_bf16():
        return precision_mod.FP32, ("auto: the cpu preset stands for this machine, whose CPU has no bf16 support (oneDNN); "
                      "its bf16 peak was measured on another host")
    return prec, why


def with_precision_note(plan: Plan, why: str) -> Plan:
    """``plan`` with a first note saying which precision it uses and why."""
    return with_note(plan, f"precision {plan.precision} ({why})", first=True)


def simulate(graph: OpGraph, plan: Plan, cluster: str | os.PathLike[str] | Cluster | None = None, *,
             measured: MeasuredCosts | None = None, calibration: Calibration = "auto",
             timeline: bool = True) -> Simulation:
    """Predict one iteration of ``plan`` for ``graph`` (made for it: checked) on
    ``cluster`` (default: the cluster embedded in the plan), with ``measured`` op costs
    when given (as the plan was searched with them) and ``calibration``."""
    strategy = plan.strategy(graph)
    cl = Cluster.from_spec(plan.cluster, plan.devices) if cluster is None else resolve_cluster(cluster, plan.devices)
    _warn_calibration(calibration, cl)
    ctx = CostContext(cl, measured, precision=precision_of(plan.precision),
                      calibration=resolve_calibration(calibration, cl))
    try:
        return predict(graph, strategy, ctx, optimizer=plan.optimizer, timeline=timeline)
    except ValueError as e:
        raise PlanFileError(f"the plan cannot be simulated on {cl.devices} x {cl.device.name}: {e}; "
                            "plan again") from None
