"""Fidelity: the simulator's predicted iteration time and peak memory against real runs
of the emitted plans on this machine's gloo processes (issue [8/8]).

    python benchmarks/fidelity.py                      # the table (about 3 minutes)
    python benchmarks/fidelity.py --reprofile          # the op profile measured afresh first
    python benchmarks/fidelity.py --calibrate          # re-measure costmodels/calibration.json first
    python benchmarks/fidelity.py [--ranks 2] [--threads 1] [--steps 10] [--warmup 3]
        [--cases mlp,gpt:data+soap] [--retries 3] [--max-wait 60] [--json out.json]

For each case (a zoo family at a size whose step takes 20-200 ms here: ``mlp`` 4 x 1024
Linear, ``gpt`` 2 layers d=256, ``cnn`` the tiny AlexNet at batch 512, ``rnn`` a 2 x
LSTM(256) language model) and each plan kind the emitter runs (``data`` = DDP, ``fsdp``
= FSDP2, ``soap`` = the planner's SOAP plan on DTensor (the best expert baseline when
the search returns data parallelism, a random one where there is none), pipelines
``gpipe`` / ``1f1b`` / ``interleaved`` (the pipeline search's best of that schedule),
``hybrid`` = pipeline x tensor parallel, which needs 4 ranks; ``dpsgd`` = D-PSGD on the
best gossip topology for the rank count, on 2 ranks the pair):

1. **profile**: every distinct op is measured alone by the profiler
   (:func:`flexsearch.cost.profiler.profile_model`, ``--threads`` threads) at the whole
   batch and at splits 2..32 (SOAP degrees, pipeline microbatches), cached in
   ``--profile`` (a rerun measures only what is new; delete the file on another
   machine). The measurements answer for the ``cpu`` preset's device
   (:meth:`~flexsearch.cost.profiler.ProfileDB.aliased`);
2. **plan**: a plan of that kind on the ``cpu`` preset, searched with the measured costs;
3. **predict**: the simulator (the planner's), with the measured op costs and the
   calibration of ``costmodels/calibration.json`` (:mod:`flexsearch.cost.calibration`);
4. **measure**: the plan emitted (:func:`flexsearch.emit.parallelize`) on ``--ranks``
   fresh gloo processes of ``--threads`` threads; a step is ``zero_grad();
   train_step(); Adam.step()`` on the same global batch (MSE against a fixed random
   target); the iteration time is the median of ``--steps`` steps after warm-up, per
   rank, the slowest rank's.

**Memory.** torch's CPU allocator keeps no statistics (``torch.cuda.memory_stats`` has
no CPU counterpart) and ``tracemalloc`` sees Python's allocator, not torch's. The rank's
resident set is used: the kernel's peak RSS (``VmHWM``), reset through
``/proc/self/clear_refs`` once the module and its optimizer are built, over the
warm-up steps (which allocate everything a step keeps: gradients, Adam state, DDP's
rebuilt buckets, pipeline buffers, and the step's activations and temporaries). glibc
is pinned meanwhile (``mallopt``: mmap threshold 64 KB, no dynamic adjustment), so that
every tensor is its own mapping and a freed one leaves the resident set; it is unpinned
before the timed steps (pinned, every large allocation page-faults: about 25 % slower).
Measured peak per rank = ``VmHWM - RSS before the steps + the rank's parameter bytes``
(resident before). The prediction for the same rank: ``(2 + optimizer state) x
parameters + activations kept``, plus the calibrated terms (DDP's gradient buckets,
the update's temporaries, the runtime's own buffers). The table shows the rank with the
larger measured peak.

**Noise.** Other processes on this 2-core machine distort every time. Before each run
the script waits (``--max-wait``) until the CPUs are nearly idle; during the timed
steps it counts the CPU time other processes took (``other``: CPUs' worth, from
``/proc/stat`` minus the ranks' own) and reruns a disturbed measurement (``> 0.25``) up
to ``--retries`` times, keeping the quietest. ``/proc/loadavg`` is printed first and last.

**Ranking.** Per case, Kendall's tau-b between the predicted and the measured order of
its plans; the headline is the mean over cases weighted by their number of plan pairs.

``--calibrate`` measures every term of the calibration (:func:`calibrate`) on probe
models that are not in the table, writes ``costmodels/calibration.json`` (each number
with this command as its source) and the raw measurements to
``costmodels/measurements/calibration-cpu.json``.

Last line: ``median_error=... max_error=... memory_median_error=... kendall_tau=...``
(|relative error| of the iteration time over all runs; of the peak memory; ranking).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from zoo import get, load_module  # noqa: E402

import flexsearch.api  # noqa: E402
from flexsearch.cost.hardware import Cluster  # noqa: E402
from flexsearch.cost.profiler import local_device, profile_model  # noqa: E402
from flexsearch.graph.opgraph import OpGraph  # noqa: E402
from flexsearch.graph.tracer import trace  # noqa: E402
from flexsearch.plan import Plan  # noqa: E402
from flexsearch.sim.simulator import Simulation, Simulator  # noqa: E402

KINDS = ("data", "fsdp", "soap", "gpipe", "1f1b", "interleaved", "hybrid", "dpsgd")
CLUSTER = "cpu"
PROFILE = ROOT / "costmodels" / "measurements" / "fidelity-profile-cpu-1t.json"
DEGREES = (2, 4, 8, 16, 32)  # profiled splits: SOAP degrees and pipeline microbatches


# ----------------------------------------------------------------------------- cases


def _mlp(batch: int = 256):
    """4 Linear layers 1024 wide (4.2M parameters), batch 256."""
    m = load_module(get("mlp_tiny"))
    model = m.MLP(1024, 1024, 1024, 4)
    return model, (torch.randn(batch, 1024),)


def _gpt(batch: int = 16):
    """GPT: 2 layers, d=256, 4 heads, vocab 2048, seq 64 (2.1M parameters), batch 16."""
    m = load_module(get("gpt_tiny"))
    cfg = m.GPTConfig(vocab_size=2048, block_size=64, n_layer=2, n_head=4, n_embd=256, dropout=0.0)
    model = m.GPT(cfg)
    return model, (torch.randint(0, cfg.vocab_size, (batch, 64)),)


def _cnn(batch: int = 512):
    """The tiny AlexNet (5 convs, 3 Linear; 3x32x32 inputs), batch 512."""
    m = load_module(get("alexnet_tiny"))
    return m.TinyAlexNet(), (torch.randn(batch, 3, 32, 32),)


def _rnn(batch: int = 32):
    """RNN language model: vocab 2000, embed 256, 2 x LSTM(256), seq 32 (2.1M parameters), batch 32."""
    m = load_module(get("rnnlm_tiny"))
    model = m.RNNLanguageModel(2000, 256, 256, 2)
    return model, (torch.randint(0, 2000, (batch, 32)),)


class Chain(torch.nn.Module):
    """``layers`` x (Linear 16 -> 16, ReLU) in a ModuleList: framework overhead per op
    with no compute to speak of; each pair is its own FSDP unit."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU()) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _deep(layers: int):
    """A deep, narrow :class:`Chain`, batch 16."""
    return Chain(layers), (torch.randn(16, 16),)


CASES = {"mlp": _mlp, "gpt": _gpt, "cnn": _cnn, "rnn": _rnn}
PROBES = {"deep8": lambda: _deep(8), "deep32": lambda: _deep(32)}
"""Models of the calibration runs (``--calibrate``), not in the table."""


def build(family: str, batch: int | None = None):
    """``(model, inputs, target)`` of a case, the same in every process (seeded)."""
    builder = CASES.get(family) or PROBES[family]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model, x = builder() if batch is None else builder(batch)
        with torch.no_grad():
            y = torch.randn(model(*x).shape)
    return model, x, y


def mse(out, target):
    return F.mse_loss(out.float(), target)


# ----------------------------------------------------------------------------- plans


def force_plan(graph: OpGraph, cl: Cluster, kind: str, measured=None, seed: int = 0,
               microbatches: int | None = None) -> Plan | None:
    """A plan of ``kind`` for ``graph`` on ``cl`` (None where the model has none), costed
    with ``measured`` op times. ``soap`` is the planner's SOAP search result (the best
    non-data baseline when the search returns data parallelism); pipelines are the
    pipeline search's best of that schedule with more than one stage."""
    from flexsearch.search.pipeline import even_pipeline, search_pipelines
    from flexsearch.search.planner import pipeline_plan, plan_graph
    from flexsearch.strategy.space import Space

    space = Space(graph, cl.devices)
    if kind == "dpsgd":
        from flexsearch.search.decentralized import best_candidate, decentralized_candidates

        base = plan_graph(graph, cl, max_iters=0, pipelines=False, ilp_max_units=0, measured=measured,
                          decentralized=False)
        best = best_candidate(decentralized_candidates(graph, cl, optimizer=base.optimizer, measured=measured))
        if best is None:
            return None
        return base.model_copy(update=dict(kind="decentralized", decisions={}, configs={}, topology=best.name,
                                           topology_edges=best.topology.edges, spectral_gap=best.spectral_gap,
                                           iterations_factor=best.iterations_factor))
    if kind in ("data", "fsdp"):
        base = plan_graph(graph, cl, max_iters=0, pipelines=False, ilp_max_units=0, measured=measured)
        configs = space.expand({u.name: space.data_parallel(u) for u in space.units})
        return base.model_copy(update=dict(kind="data", shard_params=kind == "fsdp", decisions={},
                                           configs={k: v.text for k, v in configs.items()}))
    if kind == "soap":
        best = plan_graph(graph, cl, max_iters=200, seed=seed, pipelines=False, measured=measured)
        if best.kind == "soap":
            return best
        import random

        from flexsearch.strategy.recipes import baselines

        sim = Simulator(graph, cl, measured=measured)
        options = [(sim.simulate(space.expand(d), timeline=False).iteration_time_s, name, d)
                   for name, d in baselines(space, cl.devices_per_node).items() if name != "data"]
        if not options:  # no expert plan for this model: a random one (as tests/emit_cases.py)
            rnd = random.Random(f"{graph.model}{cl.devices}{seed}")
            options = [(0.0, "random", {u.name: rnd.choice(space.candidates(u)) for u in space.units})]
        _, _, decisions = min(options, key=lambda o: o[0])
        configs = space.expand(decisions)
        return best.model_copy(update=dict(kind="soap", decisions={k: v.text for k, v in decisions.items()},
                                           configs={k: v.text for k, v in configs.items()}))
    schedule = {"hybrid": "1f1b"}.get(kind, kind)
    results = search_pipelines(graph, cl, simulate_top=1000, schedules=(schedule,), measured=measured)
    want = [r for r in results if (r.tensor > 1) == (kind == "hybrid") and r.schedule == schedule
            and len(r.stages) > 1 and r.simulation.feasible]
    if microbatches is not None:
        want = [r for r in want if r.microbatches == microbatches]
    r = want[0] if want else even_pipeline(graph, cl, schedule, 2 if kind == "hybrid" else 1, microbatches or 2,
                                             measured=measured)
    if r is None:
        return None
    base = plan_graph(graph, cl, max_iters=0, pipelines=False, ilp_max_units=0, measured=measured)
    fields = {k: getattr(base, k) for k in ("model", "graph_fingerprint", "devices", "cluster", "optimizer",
                                            "objective", "lower_bound_s", "inputs")}
    return pipeline_plan(graph, r, baselines={}, **fields)


def fsdp_units(model: torch.nn.Module, graph: OpGraph) -> dict[str, str]:
    """Node -> FSDP unit as the emitter wraps ``model`` (:mod:`flexsearch.emit.data`:
    each top-level layer with parameters, a ModuleList's items apart; layers sharing a
    parameter stay with the root, unit ``""``)."""
    from flexsearch.emit.data import _shard_units, _untied

    names = {id(m): n for n, m in model.named_modules()}
    units = [names[id(u)] for u in _untied(_shard_units(model))]
    out = {}
    for n in graph.nodes:
        out[n.name] = next((u for u in units if n.module == u or n.module.startswith(u + ".")), "")
    return out


def predict(graph: OpGraph, plan: Plan, cl: Cluster, measured=None, calibration=None,
            model: torch.nn.Module | None = None) -> Simulation:
    """The simulator's prediction for ``plan``: :func:`flexsearch.api.simulate` with the
    measured op costs (``model`` tells FSDP's units). ``calibration``: a candidate
    calibration (``--calibrate`` fitting), simulated directly instead of the one on disk."""
    units = fsdp_units(model, graph) if model is not None and plan.shard_params else None
    if calibration is None:
        return flexsearch.api.simulate(graph, plan, cl, measured=measured, fsdp_units=units)
    if plan.kind == "decentralized":
        from flexsearch.search.decentralized import replica_cost
        from flexsearch.sim.decentralized import simulate_gossip
        from flexsearch.sim.taskgraph import CostContext
        from flexsearch.strategy.topology import build as topology

        return simulate_gossip(CostContext(cl, measured, calibration=calibration),
                               replica_cost(graph, cl, measured=measured), topology(plan.topology, plan.devices),
                               optimizer=plan.optimizer)
    if plan.kind in ("pipeline", "hybrid"):
        import itertools

        from flexsearch.search.pipeline import simulate_stages
        from flexsearch.sim.taskgraph import CostContext

        ends = list(itertools.accumulate(len(st.nodes) for st in plan.stages))
        bounds = list(zip([0, *ends[:-1]], ends, strict=True))
        return simulate_stages(graph, cl, bounds=bounds, tensor=plan.tensor_degree,
                               replicas=plan.stages[0].replicas, schedule=plan.schedule,
                               microbatches=plan.microbatches, chunks=plan.chunks or 1,
                               recompute=plan.recompute, optimizer=plan.optimizer, measured=measured,
                               ctx=CostContext(cl, measured, calibration=calibration))
    return Simulator(graph, cl, optimizer=plan.optimizer, measured=measured, calibration=calibration).simulate(
        plan.node_configs(), ddp=plan.kind == "data", shard_params=plan.shard_params, fsdp_units=units)


def profile(model, inputs, threads: int, path: Path = PROFILE):
    """Measure the model's ops (full batch and the splits of :data:`DEGREES`) into
    ``path`` (kept: a rerun measures only what is new), as the ``cpu`` preset's device:
    the preset's devices are this machine's processes of ``threads`` threads."""
    db, _ = profile_model(model, inputs, out=path, threads=threads, degrees=DEGREES)
    return db.aliased(Cluster.resolve(CLUSTER, 1).device.name)


# ----------------------------------------------------------------------------- measuring


def _status(field_name: str) -> int:
    """A ``/proc/self/status`` field in bytes (``VmRSS``, ``VmHWM``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field_name}")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak RSS (VmHWM) to the current RSS


def _local_bytes(t: torch.Tensor) -> int:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.to_local()
    return t.numel() * t.element_size()


def _malloc(threshold: int) -> None:
    """Pin glibc's mmap and trim thresholds (no dynamic adjustment): at 64 KB every
    tensor is its own mapping, returned to the kernel when freed, so the resident set
    follows the live tensors."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, threshold)  # M_MMAP_THRESHOLD
    libc.mallopt(-1, 2 * threshold)  # M_TRIM_THRESHOLD
    if threshold <= 1 << 16:
        libc.malloc_trim(0)


def _foreign_cpu() -> tuple[float, float]:
    """(busy CPU seconds of the whole machine, of this process) since boot."""
    hz = os.sysconf("SC_CLK_TCK")
    cpu = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    busy = (sum(cpu) - cpu[3] - cpu[4]) / hz  # all but idle and iowait
    own = [int(v) for v in Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[11:13]]
    return busy, sum(own) / hz


def busy_cpus(window_s: float = 0.5) -> float:
    """CPUs' worth of work the whole machine did over the next ``window_s`` seconds."""
    b0, _ = _foreign_cpu()
    time.sleep(window_s)
    b1, _ = _foreign_cpu()
    return (b1 - b0) / window_s


def wait_quiet(max_wait_s: float, below: float = 0.25) -> float:
    """Wait (at most ``max_wait_s``) until other processes leave the CPUs nearly idle;
    the last load seen."""
    deadline = time.monotonic() + max_wait_s
    load = busy_cpus()
    while load > below and time.monotonic() < deadline:
        time.sleep(2.0)
        load = busy_cpus()
    return load


def quietest(run, retries: int, max_wait_s: float, noisy: float = 0.25):
    """``run()`` -> (result, foreign load); rerun (after waiting for a quiet machine)
    while the load of other processes during the run exceeded ``noisy``, at most
    ``retries`` times; the result of the quietest run."""
    best, error = None, None
    for _ in range(max(1, retries)):
        wait_quiet(max_wait_s)
        try:
            out = run()
        except RuntimeError as e:  # a rank failed (e.g. aborted): try again
            error = e
            continue
        if best is None or out[1] < best[1]:
            best = out
        if out[1] <= noisy:
            break
    if best is None:
        raise error  # type: ignore[misc]
    return best


def measure_job(rank: int, world: int, family: str, batch: int | None, plan: Plan, steps: int,
                warmup: int, forward: bool = False) -> dict[str, Any]:
    """On every rank: emit ``plan``; memory over ``warmup`` (at least 2) steps, then the
    seconds of ``steps`` more (module docstring); with ``forward`` (data and SOAP plans)
    the median seconds of a no-grad forward too."""
    import torch.distributed as dist

    from flexsearch.emit import parallelize
    from flexsearch.emit.data import batch_shard

    _malloc(1 << 16)
    model, x, y = build(family, batch)
    module = parallelize(model, plan)
    del model
    params = list(module.parameters())
    opt = torch.optim.Adam(params, lr=1e-4)
    param_bytes = sum(_local_bytes(p) for p in params)

    def step():
        opt.zero_grad()
        loss = module.train_step(x, y, mse)
        opt.step()
        return loss

    gc.collect()
    _malloc(1 << 16)
    dist.barrier()
    base = _status("VmRSS")
    _reset_peak()
    for _ in range(max(2, warmup)):
        step()
    peak = _status("VmHWM")
    _malloc(32 << 20)  # glibc's own ceiling: the heap keeps freed tensors for reuse, as by default
    for _ in range(2):
        step()
    dist.barrier()
    busy0, own0 = _foreign_cpu()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - t0)
    out = {"times": times, "rss_base": base, "rss_peak": peak, "param_bytes": param_bytes, "loss": float(loss)}
    if forward and plan.kind in ("data", "soap"):
        xs = tuple(batch_shard(t, rank, world) for t in x) if plan.kind == "data" else x

        def fwd():
            with torch.no_grad():
                module(*xs)

        dist.barrier()
        out["forward_s"] = _median_time(fwd, steps, 2)
    busy1, own1 = _foreign_cpu()
    out.update(busy_s=busy1 - busy0, own_s=own1 - own0, wall_s=sum(times))
    dist.barrier()  # no rank tears its process group down while another still uses it
    return out


@dataclass
class Row:
    case: str
    kind: str
    plan: str
    predicted_s: float = math.nan
    measured_s: float = math.nan
    predicted_bytes: float = math.nan
    measured_bytes: float = math.nan
    error: str = ""
    foreign: float = math.nan
    """CPUs' worth of other processes' work during the timed steps (0: a quiet machine)."""
    per_rank_s: list[float] = field(default_factory=list)
    per_rank_bytes: list[float] = field(default_factory=list)

    @property
    def time_error(self) -> float:
        return (self.predicted_s - self.measured_s) / self.measured_s

    @property
    def memory_error(self) -> float:
        return (self.predicted_bytes - self.measured_bytes) / self.measured_bytes


def describe(plan: Plan) -> str:
    if plan.kind in ("pipeline", "hybrid"):
        return (f"{plan.schedule} p{len(plan.stages) // (plan.chunks or 1)}x{plan.stages[0].replicas}"
                f"x{plan.tensor_degree} m{plan.microbatches}")
    if plan.kind == "data":
        return "fsdp" if plan.shard_params else "ddp"
    if plan.kind == "decentralized":
        return f"dpsgd {plan.topology}"
    kinds = {}
    for c in plan.decisions.values():
        kinds[c] = kinds.get(c, 0) + 1
    return "soap " + ",".join(f"{k}x{v}" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])[:3])


def run_case(family: str, kind: str, *, ranks: int, threads: int, steps: int, warmup: int,
             batch: int | None = None, profile_path: Path = PROFILE, timeout_s: float = 600,
             retries: int = 3, max_wait_s: float = 60.0) -> Row:
    """Plan, predict, emit and measure one (case, kind)."""
    model, x, _ = build(family, batch)
    graph = trace(model, x, name=f"fidelity:{family}")
    cl = Cluster.resolve(CLUSTER, ranks)
    db = profile(model, x, threads, profile_path)
    plan = force_plan(graph, cl, kind, measured=db)
    if plan is None:
        return Row(family, kind, "-", error="no such plan")
    row = Row(family, kind, describe(plan))
    sim = predict(graph, plan, cl, measured=db, model=model)
    measure(row, sim, family, plan, ranks=ranks, threads=threads, steps=steps, warmup=warmup, batch=batch,
            timeout_s=timeout_s, retries=retries, max_wait_s=max_wait_s)
    return row


def measure(row: Row, sim: Simulation, family: str, plan: Plan, *, ranks: int, threads: int, steps: int,
            warmup: int, batch: int | None = None, timeout_s: float = 600, retries: int = 3,
            max_wait_s: float = 60.0, forward: bool = False) -> list[dict] | None:
    """Run ``plan`` on ``ranks`` processes (the quietest of ``retries`` runs) and fill
    ``row`` with the measurement next to ``sim``'s prediction; the ranks' results."""
    from flexsearch.emit.launch import RanksFailed, run_ranks

    row.predicted_s = sim.iteration_time_s

    def run():
        res = run_ranks(measure_job, ranks, family, batch, plan, steps, warmup, forward, threads=threads,
                        timeout_s=timeout_s, pg_timeout_s=120)
        wall = max(r["wall_s"] for r in res)
        return res, max(0.0, (res[0]["busy_s"] - sum(r["own_s"] for r in res)) / wall)

    try:
        res, row.foreign = quietest(run, retries, max_wait_s)
    except RanksFailed as e:
        row.error = str(e).strip().splitlines()[-1][:200]
        return None
    row.per_rank_s = [statistics.median(r["times"]) for r in res]
    row.per_rank_bytes = [r["rss_peak"] - r["rss_base"] + r["param_bytes"] for r in res]
    row.measured_s = max(row.per_rank_s)
    worst = max(range(ranks), key=lambda i: row.per_rank_bytes[i])
    row.measured_bytes = row.per_rank_bytes[worst]
    row.predicted_bytes = sim.memory_bytes[worst]
    return res


# ----------------------------------------------------------------------------- calibration

CALIBRATION = ROOT / "costmodels" / "calibration.json"
_COLLECTIVE_SIZES = tuple(4 ** k * 64 for k in range(10))  # 64 B .. 16 MiB
_UPDATE_SETS = ((1, 1 << 22), (8, 1 << 19), (64, 1 << 16), (512, 1 << 13), (2, 1 << 17), (32, 1 << 13),
                (256, 1 << 10))
"""(tensors, elements each) of the optimizer-update measurements: bytes and tensor
counts varied independently, so the fit separates the two terms."""


def _optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-4)
    return torch.optim.SGD(params, lr=1e-4, momentum=0.9 if name == "momentum" else 0.0)


def _median_time(fn, repeats: int = 9, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _residual_line(r_a: float, r_b: float, x_a: float, x_b: float) -> tuple[float, float]:
    """``(slope, intercept)``, both clamped at 0, of the line through the simulator's
    residuals ``r_a``, ``r_b`` (measured minus predicted seconds) of two probes with
    ``x_a < x_b`` of the counted thing (tensors, collectives, actions)."""
    slope = max(0.0, (r_b - r_a) / (x_b - x_a))
    return slope, max(0.0, r_a - slope * x_a)


def _tensors(graph: OpGraph) -> int:
    """Parameter tensors of ``graph``."""
    return sum(len(n.params) for n in graph.nodes if n.param_bytes)


def _lstsq(rows: list[tuple[float, float]], ys: list[float]) -> tuple[float, float]:
    """Least squares of ``y = a x0 + b x1``, both clamped at 0."""
    import numpy as np

    sol, *_ = np.linalg.lstsq(np.array(rows, dtype=float), np.array(ys, dtype=float), rcond=None)
    return max(0.0, float(sol[0])), max(0.0, float(sol[1]))


def measure_updates(threads: int) -> dict[str, list[tuple[int, int, float]]]:
    """Per optimizer ``(tensors, bytes, seconds)`` of updates of the parameter sets of
    :data:`_UPDATE_SETS`, on plain CPU tensors."""
    torch.set_num_threads(threads)
    out = {}
    for name in ("adam", "momentum", "sgd"):
        out[name] = []
        for n, numel in _UPDATE_SETS:
            ps = [torch.nn.Parameter(torch.randn(numel)) for _ in range(n)]
            for q in ps:
                q.grad = torch.randn(numel)
            opt = _optimizer(name, ps)
            out[name].append((n, n * numel * 4, _median_time(opt.step)))
    return out


def fit_updates(per_rank: list[dict[str, list[tuple[int, int, float]]]]) -> dict[str, tuple[float, float]]:
    """``(per_tensor_s, per_byte_s)`` per optimizer: least squares over the sets, each
    set's time the slowest rank's (all ranks update at once, sharing the memory system)."""
    out = {}
    for name, rows in per_rank[0].items():
        times = [max(r[name][i][2] for r in per_rank) for i in range(len(rows))]
        out[name] = _lstsq([(n, b) for n, b, _ in rows], times)
    return out


def measure_working_tensors(threads: int) -> float:
    """Peak resident growth of an Adam update over its gradients, in multiples of the
    largest parameter tensor (glibc pinned so every tensor is its own mapping)."""
    import ctypes

    torch.set_num_threads(threads)
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD
    libc.mallopt(-1, 1 << 16)  # M_TRIM_THRESHOLD
    numel = 1 << 22
    ps = [torch.nn.Parameter(torch.randn(numel)) for _ in range(4)]
    for q in ps:
        q.grad = torch.randn(numel)
    opt = _optimizer("adam", ps)
    opt.step()
    values = []
    for _ in range(5):
        gc.collect()
        libc.malloc_trim(0)
        base = _status("VmRSS")
        _reset_peak()
        opt.step()
        values.append((_status("VmHWM") - base) / (numel * 4))
    return statistics.median(values)


def op_mix_times(threads: int) -> tuple[float, float]:
    """Summed median forward and backward seconds of a fixed mix of ops (a Linear, a
    convolution, an LSTM, a LayerNorm, a GELU; none of the benchmark's models), each
    measured alone as the profiler does."""
    from flexsearch.cost.profiler import measure_call
    from flexsearch.graph.tracer import trace_calls

    torch.set_num_threads(threads)
    mods = (
        (torch.nn.Linear(512, 2048), torch.randn(256, 512)),
        (torch.nn.Conv2d(16, 32, 3, padding=1), torch.randn(32, 16, 32, 32)),
        (torch.nn.LSTM(128, 128, batch_first=True), torch.randn(32, 16, 128)),
        (torch.nn.LayerNorm(1024), torch.randn(256, 1024)),
        (torch.nn.GELU(), torch.randn(1024, 1024)),
    )
    fwd = bwd = 0.0
    for mod, x in mods:
        graph, calls = trace_calls(torch.nn.Sequential(mod), (x,))
        for node in graph.nodes:
            if node.name in calls:
                f, b = measure_call(calls[node.name], repeats=9, warmup=3)
                fwd, bwd = fwd + f, bwd + b
    return fwd, bwd


def probe_job(rank: int, world: int, what: str, n: int) -> dict[str, float]:
    """On every rank: one calibration measurement (``calibrate``)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    if what == "overlap":  # does a collective overlap with compute on this rank's core?
        buf = torch.randn(n)
        a, b = torch.randn(512, 512), torch.randn(512, 512)

        def compute():
            for _ in range(20):
                a @ b

        def both():
            w = dist.all_reduce(buf, async_op=True)
            compute()
            w.wait()

        out = {}
        for key, fn in (("compute", compute), ("comm", lambda: dist.all_reduce(buf)), ("both", both)):
            dist.barrier()
            out[key] = _median_time(fn)
        return out
    if what == "collectives":  # t(M) of each collective the emitters use
        out = {}
        for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast"):
            rows = []
            for size in _COLLECTIVE_SIZES:
                full = torch.randn(size // 4)
                shard = torch.randn(size // 4 // world)
                fn = {"all_reduce": lambda f=full: dist.all_reduce(f),
                      "all_gather": lambda f=full, s=shard: dist.all_gather_into_tensor(f, s),
                      "reduce_scatter": lambda f=full, s=shard: dist.reduce_scatter_tensor(s, f),
                      "broadcast": lambda f=full: dist.broadcast(f, 0)}[op]
                dist.barrier()
                rows.append((size, _median_time(fn, 7 if size > 1 << 22 else 15, 2)))
            out[op] = rows
        return out
    if what == "ops":  # the op mix on every rank at once
        dist.barrier()
        f, b = op_mix_times(torch.get_num_threads())
        return {"forward": f, "backward": b}
    if what == "updates":  # every rank at once, as in training
        dist.barrier()
        return measure_updates(torch.get_num_threads())
    if what == "sharded_update":  # Adam over DTensor parameters vs plain ones
        mesh = init_device_mesh("cpu", (world,))
        out = {}
        for key in ("plain", "dtensor"):
            ps = []
            for _ in range(n):
                t = torch.randn(1024)
                if key == "dtensor":
                    t = distribute_tensor(t, mesh, [Replicate()])
                q = torch.nn.Parameter(t)
                q.grad = torch.ones_like(q)
                ps.append(q)
            opt = _optimizer("adam", ps)
            dist.barrier()
            out[key] = _median_time(opt.step)
        return out
    raise ValueError(what)


def _probe_plan(family: str, cl: Cluster, kind: str, db, microbatches: int | None = None):
    from flexsearch.strategy.space import Space

    model, x, _ = build(family)
    graph = trace(model, x, name=f"fidelity:{family}")
    if kind == "soap-dp":  # every op data parallel, run on DTensors (the SOAP emitter)
        plan = force_plan(graph, cl, "data", measured=db)
        space = Space(graph, cl.devices)
        return graph, plan.model_copy(update=dict(kind="soap", decisions={
            u.name: space.data_parallel(u).text for u in space.units}))
    return graph, force_plan(graph, cl, kind, measured=db, microbatches=microbatches)


def _forward_s(graph: OpGraph, plan: Plan, cl: Cluster, db, cal) -> float:
    """The forward compute the simulator charges device 0 (no-grad forward probes)."""
    from flexsearch.sim.taskgraph import CostContext

    ctx = CostContext(cl, db, calibration=cal, ddp=plan.kind == "data")
    configs = plan.node_configs()
    return sum(ctx.op_cost(n, configs[n.name])[0] for n in graph.nodes if 0 in configs[n.name].devices)


def _ops(graph: OpGraph) -> int:
    from flexsearch.cost.compute import FREE_KINDS

    return sum(1 for n in graph.nodes if n.kind not in FREE_KINDS)


def calibrate(ranks: int, threads: int, steps: int, warmup: int, path: Path = CALIBRATION,
              profile_path: Path = PROFILE, retries: int = 3, max_wait_s: float = 60.0) -> dict:
    """Measure every calibration term (``flexsearch.cost.calibration``) and write them to
    ``path`` with this command as their source. Each run-time overhead is the residual
    of the simulator (with the terms measured before it) on probe models whose compute
    is negligible (16-wide MLPs of 8 and 32 layers): the slope over the op count is the
    per-op overhead, the intercept the per-step cost."""
    import datetime

    from flexsearch.cost.calibration import DeviceCalibration
    from flexsearch.cost.profiler import host_info
    from flexsearch.emit.launch import run_ranks

    cl = Cluster.resolve(CLUSTER, ranks)
    host = host_info()
    when = datetime.date.today().isoformat()
    cmd = f"python benchmarks/fidelity.py --calibrate --ranks {ranks} --threads {threads}"
    where = (f"measured by `{cmd}` on {when}, {host['cpu']}, {host['cores']} cores, {ranks} gloo ranks x "
             f"{threads} threads, torch {host['torch']}, {uptime()}")
    log = {}

    def num(value: float, what: str) -> dict:
        return {"value": float(value), "source": f"{where}; {what}"}

    print(f"# calibrating: {where}", flush=True)
    wait_quiet(max_wait_s)
    colls = run_ranks(probe_job, ranks, "collectives", 0, threads=threads)
    fits = {}
    for op, rows in colls[0].items():
        times = [max(r[op][i][1] for r in colls) for i in range(len(rows))]
        a, b = _lstsq([(1.0 / t, m / t) for (m, _), t in zip(rows, times, strict=True)], [1.0] * len(rows))
        fits[op] = (a, b)  # relative least squares: t = a + b M, each size weighing alike
    log["collectives"] = colls
    print("# collectives t = a + b M: " + ", ".join(f"{op} {a * 1e6:.0f} us + {1e-9 / b if b else 0:.2f} GB/s"
                                                   for op, (a, b) in fits.items()), flush=True)
    wait_quiet(max_wait_s)
    alone = op_mix_times(threads)
    wait_quiet(max_wait_s)
    together = run_ranks(probe_job, ranks, "ops", 0, threads=threads)
    slow = (max(r["forward"] for r in together) / alone[0], max(r["backward"] for r in together) / alone[1])
    log["concurrency"] = {"alone": alone, "together": together}
    print(f"# ops on {ranks} ranks at once: x{slow[0]:.3f} forward, x{slow[1]:.3f} backward", flush=True)
    wait_quiet(max_wait_s)
    updates = fit_updates(run_ranks(probe_job, ranks, "updates", 0, threads=threads))
    log["updates"] = updates
    working = measure_working_tensors(threads)
    log["working_tensors"] = working
    wait_quiet(max_wait_s)
    over = run_ranks(probe_job, ranks, "overlap", 1 << 22, threads=threads)[0]
    overlap = (over["compute"] + over["comm"] - over["both"]) / min(over["compute"], over["comm"])
    log["overlap"] = {**over, "fraction": overlap}
    wait_quiet(max_wait_s)
    sh = run_ranks(probe_job, ranks, "sharded_update", 256, threads=threads)
    dt_tensor = max(0.0, statistics.median((r["dtensor"] - r["plain"]) / 256 for r in sh))
    log["sharded_update"] = sh
    print(f"# optimizer (per tensor s, per byte s) {updates}; working {working:.2f} tensors; overlap {over}; "
          f"DTensor update +{dt_tensor * 1e6:.1f} us/tensor", flush=True)
    raw = {
        "communication_blocks_compute": {
            "value": overlap < 0.5,
            "source": f"{where}; a 16 MB all-reduce started asynchronously during 20 512x512 matmuls hides "
                      f"{max(0.0, overlap):.0%} of the shorter of the two (compute {over['compute'] * 1e3:.1f} ms, "
                      f"all-reduce {over['comm'] * 1e3:.1f} ms, both {over['both'] * 1e3:.1f} ms); below 50%: "
                      "communication occupies the devices"},
        "optimizer": {k: {"per_tensor_s": num(a, f"{k} update on every rank at once (the slowest), least-squares "
                                                  f"fit of t = a tensors + b bytes over {len(_UPDATE_SETS)} "
                                                  "parameter sets (1..512 tensors, 4 KB..16 MB)"),
                          "per_byte_s": num(b, f"{k} update, same fit")}
                      for k, (a, b) in updates.items()},
        "sharded_update_per_tensor_s": num(dt_tensor, "Adam over 256 replicated DTensor parameters of 1024 floats "
                                                      "minus the same over plain tensors, per tensor"),
        "op_overhead": {m: {"forward_s": num(0.0, "placeholder"), "backward_s": num(0.0, "placeholder")}
                        for m in ("plain", "sharded")},
        "profiled_call": {"forward_s": num(0.0, "placeholder"), "backward_s": num(0.0, "placeholder")},
        "collectives": {op: {"ranks": ranks,
                             "latency_s": num(a, f"{op} of {_COLLECTIVE_SIZES[0]} B..{_COLLECTIVE_SIZES[-1] >> 20} MiB "
                                                 "(the slowest rank's median), relative least-squares fit of "
                                                 "t = a + b M: a"),
                             "per_byte_s": num(b, f"{op}, same fit: b")}
                        for op, (a, b) in fits.items()},
        "concurrency": {k: num(max(1.0, v), f"summed {k} time of an op mix (Linear 512x2048, Conv2d 16->32, "
                                            f"LSTM 128, LayerNorm 1024, GELU; profiled one by one) on {ranks} ranks "
                                            "at once (the slowest) over the same alone")
                        for k, v in zip(("forward", "backward"), slow, strict=True)},
        "runtime_bytes": {m: num(0.0, "placeholder") for m in ("ddp", "fsdp", "sharded", "pipeline",
                                                               "decentralized")},
        "fsdp_collective_s": num(0.0, "placeholder"),
        "pipeline_action_s": num(0.0, "placeholder"),
        "step_s": {m: num(0.0, "placeholder") for m in ("ddp", "fsdp", "sharded", "pipeline", "decentralized")},
        "ddp_bucket_bytes": {"value": 25 * 2**20, "source": "DistributedDataParallel's default bucket_cap_mb=25"},
        "ddp_first_bucket_bytes": {"value": float(2**20), "source": "torch.distributed's _DEFAULT_FIRST_BUCKET_BYTES "
                                                                     "(1 MiB; DDP's first bucket)"},
        "ddp_per_tensor_s": num(0.0, "placeholder"),
        "optimizer_working_tensors": num(working, "peak resident growth of an Adam update of 4 x 16 MB parameters "
                                                  "(glibc mmap threshold pinned at 64 KB), over one parameter's bytes"),
    }

    device = cl.device.name

    def current() -> DeviceCalibration:
        """The terms so far, written to ``path`` (the simulator's stage costs read it)."""
        cal = DeviceCalibration.model_validate(raw)
        data = {"description": "Calibration of the simulator against real runs of emitted plans, per device "
                               "(flexsearch/cost/calibration.py); written by benchmarks/fidelity.py --calibrate.",
                "command": cmd, "devices": {device: cal.model_dump(mode="json")}}
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2) + "\n")
        tmp.replace(path)  # atomic: other processes read the file
        return cal

    current()
    def probe(family: str, kind: str, microbatches: int | None = None) -> tuple[OpGraph, Plan, dict, float, float]:
        model, x, _ = build(family)
        db = profile(model, x, threads, profile_path)
        graph, plan = _probe_plan(family, cl, kind, db, microbatches)
        cal = current()
        sim = predict(graph, plan, cl, db, calibration=cal, model=model)
        row = Row(family, kind, describe(plan))
        res = measure(row, sim, family, plan, ranks=ranks, threads=threads, steps=steps, warmup=warmup,
                      retries=retries, max_wait_s=max_wait_s, forward=True)
        if res is None:
            raise RuntimeError(f"calibration probe {family} {kind} failed: {row.error}")
        meas = {"step": row.measured_s, "bytes": row.measured_bytes, "predicted_bytes": row.predicted_bytes,
                "foreign": row.foreign}
        if "forward_s" in res[0]:
            meas["forward"] = max(r["forward_s"] for r in res)
        fwd = _forward_s(graph, plan, cl, db, cal) if "forward" in meas else 0.0
        print(f"#   probe {family} {describe(plan)}: measured {meas}, predicted step {sim.iteration_time_s * 1e3:.2f} "
              f"ms, forward {fwd * 1e3:.2f} ms", flush=True)
        log.setdefault("probes", []).append({"case": family, "plan": describe(plan), "measured": meas,
                                             "predicted_step_s": sim.iteration_time_s, "predicted_forward_s": fwd})
        return graph, plan, meas, sim.iteration_time_s, fwd

    def floor(mode: str, meas: dict, what: str) -> None:
        raw["runtime_bytes"][mode] = num(max(0.0, meas["bytes"] - meas["predicted_bytes"]),
                                         f"{what}: measured peak memory (benchmarks/fidelity.py's method) minus "
                                         "the simulator's")

    # plain ops: the model alone in this process, against the simulator on one device
    one = Cluster.resolve(CLUSTER, 1)
    local = {}
    for family in ("deep8", "deep32"):
        model, x, y = build(family)
        db = profile(model, x, threads, profile_path)
        graph = trace(model, x, name=f"fidelity:{family}")
        plan = force_plan(graph, one, "data", measured=db)
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)

        def step(model=model, x=x, y=y, opt=opt):
            opt.zero_grad()
            mse(model(*x), y).backward()
            opt.step()

        def forward(model=model, x=x):
            with torch.no_grad():
                model(*x)

        wait_quiet(max_wait_s)
        meas = {"step": _median_time(step, steps, warmup), "forward": _median_time(forward, steps, warmup)}
        cal = current()
        pred = predict(graph, plan, one, db, calibration=cal).iteration_time_s
        local[family] = (graph, meas, pred, _forward_s(graph, plan, one, db, cal))
        log.setdefault("probes", []).append({"case": family, "plan": "one process", "measured": meas,
                                             "predicted_step_s": pred})
        print(f"#   probe {family} one process: measured {meas}, predicted step {pred * 1e3:.2f} ms", flush=True)
    (g8, m8, p8, f8), (g32, m32, p32, f32) = local["deep8"], local["deep32"]
    dops = _ops(g32) - _ops(g8)
    fwd = ((m32["forward"] - m8["forward"]) - (f32 - f8)) / dops
    bwd = ((m32["step"] - m8["step"]) - (p32 - p8)) / dops - fwd
    what = ("residual of the simulator (one device, profiled op times) on one process training 16-wide MLPs "
            f"of 8 and 32 layers ({_ops(g8)} and {_ops(g32)} ops; medians of {steps} steps)")
    raw["op_overhead"]["plain"] = {"forward_s": num(max(0.0, fwd), f"{what}: no-grad forward slope per op"),
                                   "backward_s": num(max(0.0, bwd), f"{what}: step slope per op minus the "
                                                                    "forward's")}
    raw["profiled_call"] = {"forward_s": num(max(0.0, -fwd), f"{what}: minus the no-grad forward slope per op"),
                            "backward_s": num(max(0.0, -bwd), f"{what}: minus the step slope per op less the "
                                                              "forward's")}
    print(f"# plain: op overhead {fwd * 1e6:.1f} + {bwd * 1e6:.1f} us (negative: the profiler's per call)",
          flush=True)

    # DDP: per gradient tensor (hooks) and per step, on top of the plain ops
    g8, _, m8, p8, _ = probe("deep8", "data")
    g32, _, m32, p32, _ = probe("deep32", "data")
    per_tensor, base = _residual_line(m8["step"] - p8, m32["step"] - p32, _tensors(g8), _tensors(g32))
    what = f"residual of the simulator on DDP runs of 16-wide MLPs of 8 and 32 layers (medians of {steps} steps)"
    raw["ddp_per_tensor_s"] = num(per_tensor, f"{what}: slope per parameter tensor")
    raw["step_s"]["ddp"] = num(base, f"{what}: intercept per step")
    floor("ddp", m8, what.replace("MLPs of 8 and 32 layers", "MLP of 8 layers"))
    print(f"# ddp: {per_tensor * 1e6:.1f} us per tensor, step {base * 1e3:.2f} ms", flush=True)

    # FSDP: per unit collective (all-gather in the forward and the backward, reduce-scatter)
    g8, _, m8, p8, _ = probe("deep8", "fsdp")
    g32, _, m32, p32, _ = probe("deep32", "fsdp")
    per_coll, base = _residual_line(m8["step"] - p8, m32["step"] - p32, 3 * 8, 3 * 32)
    what = (f"residual of the simulator on FSDP runs of 16-wide MLPs of 8 and 32 layers, one unit each "
            f"(medians of {steps} steps)")
    raw["fsdp_collective_s"] = num(per_coll, f"{what}: slope per unit collective (3 per unit)")
    raw["step_s"]["fsdp"] = num(base, f"{what}: intercept per step")
    floor("fsdp", m8, what.replace("MLPs of 8 and 32 layers", "MLP of 8 layers"))
    print(f"# fsdp: {per_coll * 1e6:.1f} us per unit collective, step {base * 1e3:.2f} ms", flush=True)

    # DTensor ops (SOAP plans, every op data parallel on DTensors)
    g8, _, m8, p8, f8 = probe("deep8", "soap-dp")
    g32, _, m32, p32, f32 = probe("deep32", "soap-dp")
    dops = _ops(g32) - _ops(g8)
    fo = max(0.0, ((m32["forward"] - m8["forward"]) - (f32 - f8)) / dops)
    bo = max(0.0, ((m32["step"] - m8["step"]) - (p32 - p8)) / dops - fo)
    base = max(0.0, (m8["step"] - p8) - _ops(g8) * (fo + bo))
    what = (f"residual of the simulator on SOAP (DTensor) runs of 16-wide MLPs of 8 and 32 layers, every op data "
            f"parallel ({_ops(g8)} and {_ops(g32)} ops; medians of {steps} steps)")
    raw["op_overhead"]["sharded"] = {"forward_s": num(fo, f"{what}: no-grad forward slope per op"),
                                     "backward_s": num(bo, f"{what}: step slope per op minus the forward's")}
    raw["step_s"]["sharded"] = num(base, f"{what}: intercept per step")
    floor("sharded", m8, what.replace("MLPs of 8 and 32 layers", "MLP of 8 layers"))
    print(f"# sharded: op overhead {fo * 1e6:.1f} + {bo * 1e6:.1f} us, step {base * 1e3:.2f} ms", flush=True)

    _, pl2, m2, p2, _ = probe("deep32", "gpipe", microbatches=2)
    _, pl8, m8, p8, _ = probe("deep32", "gpipe", microbatches=8)
    stages = len(pl2.stages)
    action, base = _residual_line(m2["step"] - p2, m8["step"] - p8, 2 * (2 + stages - 1), 2 * (8 + stages - 1))
    what = ("residual of the simulator on GPipe runs of a 16-wide MLP of 32 layers over 2 stages with 2 and 8 "
            f"microbatches (medians of {steps} steps)")
    raw["pipeline_action_s"] = num(action, f"{what}: slope per forward or backward action of a stage")
    raw["step_s"]["pipeline"] = num(base, f"{what}: intercept per step (critical path of (m + p - 1) forward "
                                          "and backward actions)")
    floor("pipeline", m2, what.replace("with 2 and 8 microbatches", "with 2 microbatches"))
    print(f"# pipeline: action {action * 1e6:.1f} us, step {base * 1e3:.2f} ms", flush=True)

    # D-PSGD: the fixed cost per step (posting and waiting for the gossip, the loss all-reduce)
    _, _, m8, p8, _ = probe("deep8", "dpsgd")
    _, _, m32, p32, _ = probe("deep32", "dpsgd")
    r8, r32 = m8["step"] - p8, m32["step"] - p32
    base = max(0.0, (r8 + r32) / 2)
    what = (f"residual of the simulator on D-PSGD runs of 16-wide MLPs of 8 and 32 layers ({r8 * 1e3:.2f} and "
            f"{r32 * 1e3:.2f} ms; medians of {steps} steps)")
    raw["step_s"]["decentralized"] = num(base, f"{what}: their mean per step")
    floor("decentralized", m8, what.replace("MLPs of 8 and 32 layers", "MLP of 8 layers"))
    print(f"# decentralized: step {base * 1e3:.2f} ms (residuals {r8 * 1e3:.2f}, {r32 * 1e3:.2f} ms)", flush=True)

    current()
    log_path = ROOT / "costmodels" / "measurements" / "calibration-cpu.json"
    log_path.write_text(json.dumps({"command": cmd, "date": when, "host": host, "load": uptime(),
                                    "measurements": log}, indent=1, default=str) + "\n")
    print(f"# wrote {path} and {log_path}")
    return raw


# ----------------------------------------------------------------------------- statistics


def kendall_tau(x: list[float], y: list[float]) -> float:
    """Kendall's tau-b of two equally long sequences (nan for fewer than 2 items)."""
    n = len(x)
    conc = disc = tx = ty = 0
    for i in range(n):
        for j in range(i + 1, n):
            a = (x[i] > x[j]) - (x[i] < x[j])
            b = (y[i] > y[j]) - (y[i] < y[j])
            if a == 0 and b == 0:
                continue
            if a == 0:
                tx += 1
            elif b == 0:
                ty += 1
            elif a == b:
                conc += 1
            else:
                disc += 1
    denom = math.sqrt((conc + disc + tx) * (conc + disc + ty))
    return (conc - disc) / denom if denom else math.nan


def summary(rows: list[Row]) -> dict[str, float]:
    ok = [r for r in rows if not r.error]
    errs = [abs(r.time_error) for r in ok]
    mems = [abs(r.memory_error) for r in ok]
    taus, weights = [], []
    for case in dict.fromkeys(r.case for r in ok):
        rs = [r for r in ok if r.case == case]
        tau = kendall_tau([r.predicted_s for r in rs], [r.measured_s for r in rs])
        if not math.isnan(tau):
            taus.append(tau)
            weights.append(len(rs) * (len(rs) - 1) / 2)
    return {
        "median_error": statistics.median(errs) if errs else math.nan,
        "max_error": max(errs) if errs else math.nan,
        "memory_median_error": statistics.median(mems) if mems else math.nan,
        "kendall_tau": sum(t * w for t, w in zip(taus, weights, strict=True)) / sum(weights) if taus else math.nan,
    }


def uptime() -> str:
    try:
        return "load average " + ", ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "load average unknown"


def parse_cases(text: str | None) -> list[tuple[str, str]]:
    """``mlp,gpt:data+soap`` -> [(mlp, every kind), (gpt, data), (gpt, soap)]."""
    if not text:
        return [(f, k) for f in CASES for k in KINDS]
    out = []
    for item in text.split(","):
        fam, _, kinds = item.partition(":")
        if fam not in CASES:
            raise SystemExit(f"unknown case {fam!r}; choose from {', '.join(CASES)}")
        for k in (kinds.split("+") if kinds else KINDS):
            if k not in KINDS:
                raise SystemExit(f"unknown plan kind {k!r}; choose from {', '.join(KINDS)}")
            out.append((fam, k))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--cases", default=None, help="e.g. mlp,gpt:data+soap (default: every case and kind)")
    ap.add_argument("--profile", type=Path, default=PROFILE, help="op profile cache")
    ap.add_argument("--reprofile", action="store_true",
                    help="measure the op profile afresh (this host's speed drifts: profile and runs alike)")
    ap.add_argument("--json", type=Path, default=None, help="write every row here")
    ap.add_argument("--retries", type=int, default=3,
                    help="rerun a measurement disturbed by other processes (> 0.25 CPUs busy) up to this often")
    ap.add_argument("--max-wait", type=float, default=60.0,
                    help="seconds to wait for a quiet machine before each measurement")
    ap.add_argument("--calibrate", action="store_true",
                    help=f"measure the calibration terms into {CALIBRATION.relative_to(ROOT)} first")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.reprofile and args.profile.exists():
        args.profile.unlink()
    if args.calibrate:
        calibrate(args.ranks, args.threads, max(args.steps, 40), args.warmup, profile_path=args.profile,
                  retries=args.retries, max_wait_s=args.max_wait)
        if args.cases is None:
            return
    print(f"# {uptime()}; {args.ranks} ranks x {args.threads} threads, device {local_device(args.threads)}, "
          f"torch {torch.__version__}", flush=True)
    print(f"{'case':5} {'kind':11} {'plan':26} {'pred ms':>9} {'meas ms':>9} {'err':>7} "
          f"{'pred MB':>9} {'meas MB':>9} {'err':>7} {'other':>5}", flush=True)
    rows = []
    for fam, kind in parse_cases(args.cases):
        t0 = time.perf_counter()
        row = run_case(fam, kind, ranks=args.ranks, threads=args.threads, steps=args.steps, warmup=args.warmup,
                       profile_path=args.profile, retries=args.retries, max_wait_s=args.max_wait)
        rows.append(row)
        if row.error:
            print(f"{fam:5} {kind:11} {row.plan:26} {row.error}", flush=True)
            continue
        print(f"{fam:5} {kind:11} {row.plan:26} {row.predicted_s * 1e3:9.2f} {row.measured_s * 1e3:9.2f} "
              f"{row.time_error:+7.1%} {row.predicted_bytes / 1e6:9.1f} {row.measured_bytes / 1e6:9.1f} "
              f"{row.memory_error:+7.1%} {row.foreign:5.2f}  ({time.perf_counter() - t0:.0f} s)", flush=True)
    s = summary(rows)
    if args.json is not None:
        args.json.write_text(json.dumps({"rows": [asdict(r) for r in rows], "summary": s,
                                         "load": uptime()}, indent=1))
    print(f"# {uptime()}")
    print(" ".join(f"{k}={v:.3f}" for k, v in s.items()))


if __name__ == "__main__":
    main()
