"""``flexsearch calibrate``: measure this machine's calibration, stage by stage, resumably.

Each stage (:data:`STAGES`) measures one thing on the probes of :mod:`.probes` and
keeps its raw numbers in a progress file next to the output (``<out>.partial.json``),
so a run that is interrupted resumes at the first stage it has not finished (with the
same ranks, threads, steps and torch; otherwise it starts over and says so). When every
stage is measured, :func:`assemble` turns the numbers into the terms of
:class:`~flexsearch.cost.calibration.DeviceCalibration` in order, each run-time
overhead the residual of the simulator (with the terms fitted before it) on the probes:

1. ``collectives``: each collective's ``t = a + b M`` (:func:`.fit.fit_collective`);
2. ``concurrency``: the op mix on every rank at once over the same alone (factors >= 1;
   both in the same processes, interleaved);
3. ``updates``: each optimizer's per-tensor and per-byte cost;
4. ``working``: the update's temporaries in largest-tensor multiples;
5. ``overlap``: whether communication blocks compute (less than half hidden);
6. ``sharded_update``: the extra per-tensor cost of DTensor parameters;
7. ``plain``: one process training the probes: the per-op overhead of plain modules
   (negative: the profiler's per-call cost, ``profiled_call``);
8. ``ddp``: per gradient tensor (hooks) and per step; ``zero1``: per parameter tensor
   and per step of ``ZeroRedundancyOptimizer`` beyond DDP; 9. ``fsdp``: per unit collective
   and per step; 10. ``sharded``: DTensor ops' per-op overhead and per step (SOAP
   plans, every op data parallel on DTensors); 11. ``pipeline``: per schedule action
   and per step (GPipe over 2 stages with 2 and 8 microbatches); 12. ``decentralized``:
   per step; 13. ``moves``: per move of a SOAP plan between device blocks (each
   probe layer on the next device in turn). Stages 8-12 (but ``zero1``, which runs
   DDP's runtime) also give each mode's ``runtime_bytes``: measured peak memory minus
   the simulator's.

Every stage but the profile is measured ``repeats`` times (:class:`Settings`), in
rounds over all stages (a burst of load from elsewhere spoils one sample of several
terms, not every sample of one); each round is fitted on its own and the rounds are
combined term by term (:func:`.fit.combine`: outliers rejected, the median kept, half
the kept range recorded as the term's ``spread``). The probes' step times across the
rounds give the calibration's ``step_spread``: how close two predictions can be and
still be told apart by measuring.

The calibration is written atomically into the output file (other devices' entries are
kept), every number with the command, date, host and load as its source, and the raw
measurements next to it (``<out stem>-measurements.json``).
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flexsearch.calibrate import fit, probes
from flexsearch.cost.calibration import (
    CalibrationFile,
    DeviceCalibration,
    HostRecord,
    user_calibration_path,
)
from flexsearch.cost.hardware import Cluster, user_dir
from flexsearch.errors import CalibrationError
from flexsearch.graph.opgraph import OpGraph
from flexsearch.measure import Measurement, load_average, measure_plan, wait_quiet
from flexsearch.plan import Plan
from flexsearch.strategy.kinds import Strategy

CLUSTER = "cpu"
"""The preset whose device is calibrated: this machine's gloo processes."""
MODES = ("ddp", "zero1", "fsdp", "sharded", "pipeline", "decentralized")
STAGES = ("profile", "collectives", "concurrency", "updates", "working", "overlap", "sharded_update", "plain",
          *MODES, "moves")
DEGREES = (2, 4, 8, 16, 32)
"""Sample splits profiled: the probes' per-rank batches and pipeline microbatches."""


@dataclass(frozen=True)
class Settings:
    """What a calibration run measures with (a resumed run must match)."""

    ranks: int = 2
    threads: int = 1
    steps: int = 40
    warmup: int = 3
    retries: int = 3
    max_wait_s: float = 60.0
    repeats: int = 3
    """Rounds of every measuring stage (the profile is measured once)."""

    @property
    def command(self) -> str:
        return (f"flexsearch calibrate --ranks {self.ranks} --threads {self.threads} --steps {self.steps} "
                f"--repeats {self.repeats}")

    def key(self) -> dict:
        from flexsearch.cost.profiler import host_info

        return {"ranks": self.ranks, "threads": self.threads, "steps": self.steps, "warmup": self.warmup,
                "repeats": self.repeats, "host": host_info()}


def default_profile_path(threads: int) -> Path:
    """The probes' op profile on this machine."""
    return user_dir() / "profiles" / f"calibration-cpu-{threads}t.json"


# ----------------------------------------------------------------------------- probe plans


def _probe(name: str):
    model, x, _ = probes.build_probe(name)
    from flexsearch.graph.tracer import trace

    return model, x, trace(model, x, name=f"calibration:{name}")


def probe_strategy(graph: OpGraph, cl: Cluster, mode: str, microbatches: int = 2) -> Strategy:
    """The probe plan of an execution mode: every op data parallel with DDP, FSDP2 or on
    DTensors (``sharded``; ``plain`` on one device: the model alone in one process);
    GPipe over two even stages; D-PSGD on a ring."""
    from flexsearch.strategy import recipes
    from flexsearch.strategy.config import Config, is_source
    from flexsearch.strategy.fsdp import fsdp_units
    from flexsearch.strategy.kinds import DataParallel, Decentralized, Pipelined, Soap
    from flexsearch.strategy.space import Space
    from flexsearch.strategy.topology import build

    space = Space(graph, cl.devices)
    dp = recipes.data_parallel(space)
    configs = space.expand(dp)
    if mode == "ddp":
        return DataParallel(configs, dp)
    if mode == "zero1":
        return DataParallel(configs, dp, shard="zero1")
    if mode == "fsdp":
        return DataParallel(configs, dp, shard="zero3", fsdp_units=fsdp_units(graph.modules))
    if mode in ("sharded", "plain"):  # plain: one process, the model as it is
        return Soap(configs, dp)
    if mode == "moves":  # layer k whole on device k mod n: a _Move between every two layers
        return Soap({n.name: configs[n.name] if is_source(n) else Config(first=_layer(n) % cl.devices)
                     for n in graph.nodes})
    if mode == "pipeline":
        n = len(graph.nodes)
        return Pipelined(((0, n // 2), (n // 2, n)), tensor=1, replicas=cl.devices // 2, schedule="gpipe",
                         microbatches=microbatches)
    return Decentralized(build("ring", cl.devices))


def _layer(node) -> int:
    """The probe layer a node belongs to (its module ``layers.K.J``)."""
    return int(node.module.split(".")[1])


def probe_plan(graph: OpGraph, cl: Cluster, strategy: Strategy) -> Plan:
    """A plan file for a probe strategy (its prediction is not used: ``assemble`` makes it)."""
    from flexsearch.search.results import plan_from
    from flexsearch.sim.result import Simulation

    empty = Simulation(0.0, (0.0,) * cl.devices, cl.device.memory_capacity.value, (), (), (), 0.0, 0.0)
    return plan_from(graph, cl, strategy, empty, baselines={}, lower_bound_s=0.0)


def _as_record(m: Measurement) -> dict:
    return {"step": m.time_s, "bytes": m.peak_bytes[m.worst_rank], "worst_rank": m.worst_rank,
            "forward": m.forward_s, "foreign": m.foreign}


# ----------------------------------------------------------------------------- stages


def measure_stage(stage: str, s: Settings, profile_path: Path) -> Any:
    """Run one stage's measurements (module docstring); JSON-able raw numbers."""
    from flexsearch.emit.launch import run_ranks

    cl = Cluster.resolve(CLUSTER, s.ranks)
    if stage == "profile":
        from flexsearch.cost.profiler import profile_model

        for name in probes.PROBES:
            model, x, _ = probes.build_probe(name)
            profile_model(model, x, out=profile_path, threads=s.threads, degrees=DEGREES)
        return str(profile_path)
    wait_quiet(s.max_wait_s)
    if stage == "collectives":
        return run_ranks(probes.probe_job, s.ranks, "collectives", 0, threads=s.threads)
    if stage == "concurrency":  # alone and together in the same processes, interleaved
        together = run_ranks(probes.probe_job, s.ranks, "ops", 0, threads=s.threads)
        return {"alone": together[0]["alone"], "together": together}
    if stage == "updates":
        return run_ranks(probes.probe_job, s.ranks, "updates", 0, threads=s.threads)
    if stage == "working":
        return probes.measure_working_tensors(s.threads)
    if stage == "overlap":
        return run_ranks(probes.probe_job, s.ranks, "overlap", 1 << 22, threads=s.threads)[0]
    if stage == "sharded_update":
        return run_ranks(probes.probe_job, s.ranks, "sharded_update", 256, threads=s.threads)
    if stage == "plain":
        torch.set_num_threads(s.threads)
        return {name: probes.local_step(name, s.steps, s.warmup) for name in probes.PROBES}
    out = {}
    cases = {"m2": ("deep32", 2), "m8": ("deep32", 8)} if stage == "pipeline" else {p: (p, 2) for p in probes.PROBES}
    for key, (name, m) in cases.items():
        _, _, graph = _probe(name)
        plan = probe_plan(graph, cl, probe_strategy(graph, cl, stage, m))
        meas = measure_plan(probes.build_probe, (name,), plan, ranks=s.ranks, threads=s.threads, steps=s.steps,
                            warmup=s.warmup, forward=stage in ("ddp", "sharded"), retries=s.retries,
                            max_wait_s=s.max_wait_s)
        out[key] = _as_record(meas)
    return out


# ----------------------------------------------------------------------------- fitting


class Predictor:
    """The simulator's step, forward and memory for the probes under a calibration."""

    def __init__(self, ranks: int, profile_path: Path):
        from flexsearch.cost.profiler import ProfileDB

        self.cl = Cluster.resolve(CLUSTER, ranks)
        self.one = Cluster.resolve(CLUSTER, 1)
        db = ProfileDB.load(profile_path, device=None)
        self.db = db.aliased(self.cl.device.name)
        self.graphs = {name: _probe(name)[2] for name in probes.PROBES}

    def __call__(self, name: str, mode: str, cal: DeviceCalibration, *, worst: int = 0, microbatches: int = 2,
                 one: bool = False) -> dict[str, float]:
        from flexsearch.sim.context import CostContext
        from flexsearch.sim.predict import predict

        cl = self.one if one else self.cl
        graph = self.graphs[name]
        strategy = probe_strategy(graph, cl, mode, microbatches)
        ctx = CostContext(cl, self.db, calibration=cal)
        sim = predict(graph, strategy, ctx, timeline=False)
        fctx = ctx.as_ddp() if mode == "ddp" else ctx
        configs = getattr(strategy, "configs", {})
        fwd = sum(fctx.op_cost(n, configs[n.name])[0] for n in graph.nodes if configs and 0 in configs[n.name].devices)
        return {"step": sim.iteration_time_s, "forward": fwd, "bytes": sim.memory_bytes[worst]}


def _ops(graph: OpGraph) -> int:
    from flexsearch.cost.compute import FREE_KINDS

    return sum(1 for n in graph.nodes if n.kind not in FREE_KINDS)


def _tensors(graph: OpGraph) -> int:
    return sum(len(n.params) for n in graph.nodes if n.param_bytes)


def assemble(raw: dict[str, Any], s: Settings, where: str, profile_path: Path) -> DeviceCalibration:
    """The calibration from every stage's raw numbers (module docstring), each term with
    ``where`` and how it was fitted as its source; predictions use the probes' op
    profile at ``profile_path``."""
    predict = Predictor(s.ranks, profile_path)

    def num(value: float, what: str) -> dict:
        return {"value": float(value), "source": f"{where}; {what}"}

    fits = {op: fit.fit_collective(fit.slowest(raw["collectives"], op)) for op in raw["collectives"][0]}
    alone, together = raw["concurrency"]["alone"], raw["concurrency"]["together"]
    slow = (max(r["forward"] for r in together) / alone[0], max(r["backward"] for r in together) / alone[1])
    updates = fit.fit_updates(raw["updates"])
    over = raw["overlap"]
    overlap = fit.overlap_fraction(over["compute"], over["comm"], over["both"])
    sh = raw["sharded_update"]
    dt_tensor = max(0.0, sorted((r["dtensor"] - r["plain"]) / 256 for r in sh)[len(sh) // 2])
    zero = {"value": 0.0, "source": f"{where}; not fitted yet"}
    cal: dict[str, Any] = {
        "communication_blocks_compute": {
            "value": overlap < 0.5,
            "source": f"{where}; a 16 MB all-reduce started asynchronously during 20 512x512 matmuls hides "
                      f"{max(0.0, overlap):.0%} of the shorter of the two (compute {over['compute'] * 1e3:.1f} ms, "
                      f"all-reduce {over['comm'] * 1e3:.1f} ms, both {over['both'] * 1e3:.1f} ms; medians of "
                      f"{probes.OVERLAP_SAMPLES} interleaved samples); below 50%: "
                      "communication occupies the devices"},
        "optimizer": {k: {"per_tensor_s": num(a, f"{k} update on every rank at once (the slowest), least-squares "
                                                  f"fit of t = a tensors + b bytes over {len(probes.UPDATE_SETS)} "
                                                  "parameter sets (1..512 tensors, 4 KB..16 MB)"),
                          "per_byte_s": num(b, f"{k} update, same fit")} for k, (a, b) in updates.items()},
        "sharded_update_per_tensor_s": num(dt_tensor, "Adam over 256 replicated DTensor parameters of 1024 floats "
                                                      "minus the same over plain tensors, per tensor"),
        "op_overhead": {m: {"forward_s": zero, "backward_s": zero} for m in ("plain", "sharded")},
        "profiled_call": {"forward_s": zero, "backward_s": zero},
        "collectives": {op: {"ranks": s.ranks,
                             "latency_s": num(a, f"{op} of {probes.COLLECTIVE_SIZES[0]} B.."
                                                 f"{probes.COLLECTIVE_SIZES[-1] >> 20} MiB (the slowest rank's "
                                                 "median), relative least-squares fit of t = a + b M: a"),
                             "per_byte_s": num(b, f"{op}, same fit: b")} for op, (a, b) in fits.items()},
        "concurrency": {k: num(max(1.0, v), f"summed {k} time of an op mix (Linear 512x2048, Conv2d 16->32, "
                                            f"LSTM 128, LayerNorm 1024, GELU; profiled one by one) on {s.ranks} ranks "
                                            "at once (the slowest) over the same alone on rank 0, the others idle "
                                            f"(medians of {probes.CONCURRENCY_SAMPLES} interleaved samples)")
                        for k, v in zip(("forward", "backward"), slow, strict=True)},
        "runtime_bytes": {m: zero for m in MODES if m != "zero1"},  # ZeRO-1 runs DDP's runtime
        "fsdp_collective_s": zero,
        "pipeline_action_s": zero,
        "step_s": {m: zero for m in MODES},
        "ddp_bucket_bytes": {"value": 25 * 2**20, "source": "DistributedDataParallel's default bucket_cap_mb=25"},
        "ddp_first_bucket_bytes": {"value": float(2**20), "source": "torch.distributed's _DEFAULT_FIRST_BUCKET_BYTES "
                                                                     "(1 MiB; DDP's first bucket)"},
        "ddp_per_tensor_s": zero,
        "optimizer_working_tensors": num(raw["working"], "peak resident growth of an Adam update of 4 x 16 MB "
                                                         "parameters (glibc mmap threshold pinned at 64 KB), over "
                                                         "one parameter's bytes"),
    }

    def current() -> DeviceCalibration:
        return DeviceCalibration.model_validate(cal)

    g8, g32 = (_probe(name)[2] for name in probes.PROBES)
    ops8, ops32 = _ops(g8), _ops(g32)
    tensors8, tensors32 = _tensors(g8), _tensors(g32)

    def residuals(mode: str) -> tuple[dict, dict, dict, dict]:
        """Measured and predicted (under the terms so far) of the deep8 and deep32 probes."""
        m8, m32 = raw[mode]["deep8"], raw[mode]["deep32"]
        c = current()
        return m8, m32, predict("deep8", mode, c, worst=m8["worst_rank"]), \
            predict("deep32", mode, c, worst=m32["worst_rank"])

    def floor(mode: str, m: dict, p: dict, what: str) -> None:
        cal["runtime_bytes"][mode] = num(max(0.0, m["bytes"] - p["bytes"]),
                                         f"{what}: measured peak memory (flexsearch.measure's method) minus the "
                                         "simulator's")

    # plain ops: one process alone, against the simulator on one device
    c = current()
    l8, l32 = raw["plain"]["deep8"], raw["plain"]["deep32"]
    p8, p32 = predict("deep8", "plain", c, one=True), predict("deep32", "plain", c, one=True)
    dops = ops32 - ops8
    fwd = ((l32["forward"] - l8["forward"]) - (p32["forward"] - p8["forward"])) / dops
    bwd = ((l32["step"] - l8["step"]) - (p32["step"] - p8["step"])) / dops - fwd
    what = (f"residual of the simulator (one device, profiled op times) on one process training 16-wide MLPs of 8 "
            f"and 32 layers ({ops8} and {ops32} ops; medians of {s.steps} steps)")
    cal["op_overhead"]["plain"] = {"forward_s": num(max(0.0, fwd), f"{what}: no-grad forward slope per op"),
                                   "backward_s": num(max(0.0, bwd), f"{what}: step slope per op minus the forward's")}
    cal["profiled_call"] = {"forward_s": num(max(0.0, -fwd), f"{what}: minus the no-grad forward slope per op"),
                            "backward_s": num(max(0.0, -bwd), f"{what}: minus the step slope per op less the "
                                                              "forward's")}

    # DDP: per gradient tensor (hooks) and per step
    m8, m32, p8, p32 = residuals("ddp")
    per_tensor, base = fit.residual_line(m8["step"] - p8["step"], m32["step"] - p32["step"], tensors8, tensors32)
    what = f"residual of the simulator on DDP runs of 16-wide MLPs of 8 and 32 layers (medians of {s.steps} steps)"
    cal["ddp_per_tensor_s"] = num(per_tensor, f"{what}: slope per parameter tensor")
    cal["step_s"]["ddp"] = num(base, f"{what}: intercept per step")
    floor("ddp", m8, predict("deep8", "ddp", current(), worst=m8["worst_rank"]), "DDP run of the 8-layer MLP")

    # ZeRO-1: per parameter tensor (the optimizer's bookkeeping, a broadcast each) and per step
    m8, m32, p8, p32 = residuals("zero1")
    per_tensor, base = fit.residual_line(m8["step"] - p8["step"], m32["step"] - p32["step"], tensors8, tensors32)
    what = (f"residual of the simulator on DDP + ZeroRedundancyOptimizer runs of 16-wide MLPs of 8 and 32 layers "
            f"(medians of {s.steps} steps)")
    cal["zero1_per_tensor_s"] = num(per_tensor, f"{what}: slope per parameter tensor")
    cal["step_s"]["zero1"] = num(base, f"{what}: intercept per step")

    # FSDP: per unit collective (all-gather in the forward and the backward, reduce-scatter)
    m8, m32, p8, p32 = residuals("fsdp")
    per_coll, base = fit.residual_line(m8["step"] - p8["step"], m32["step"] - p32["step"], 3 * 8, 3 * 32)
    what = (f"residual of the simulator on FSDP runs of 16-wide MLPs of 8 and 32 layers, one unit each (medians "
            f"of {s.steps} steps)")
    cal["fsdp_collective_s"] = num(per_coll, f"{what}: slope per unit collective (3 per unit)")
    cal["step_s"]["fsdp"] = num(base, f"{what}: intercept per step")
    floor("fsdp", m8, predict("deep8", "fsdp", current(), worst=m8["worst_rank"]), "FSDP run of the 8-layer MLP")

    # DTensor ops (SOAP plans, every op data parallel on DTensors)
    m8, m32, p8, p32 = residuals("sharded")
    fo = max(0.0, ((m32["forward"] - m8["forward"]) - (p32["forward"] - p8["forward"])) / dops)
    bo = max(0.0, ((m32["step"] - m8["step"]) - (p32["step"] - p8["step"])) / dops - fo)
    base = max(0.0, (m8["step"] - p8["step"]) - ops8 * (fo + bo))
    what = (f"residual of the simulator on SOAP (DTensor) runs of 16-wide MLPs of 8 and 32 layers, every op data "
            f"parallel ({ops8} and {ops32} ops; medians of {s.steps} steps)")
    cal["op_overhead"]["sharded"] = {"forward_s": num(fo, f"{what}: no-grad forward slope per op"),
                                     "backward_s": num(bo, f"{what}: step slope per op minus the forward's")}
    cal["step_s"]["sharded"] = num(base, f"{what}: intercept per step")
    floor("sharded", m8, predict("deep8", "sharded", current(), worst=m8["worst_rank"]),
          "SOAP run of the 8-layer MLP")

    # SOAP moves between device blocks: per move, each way (the probes' moves as the
    # simulator counts them on the critical path: its step's growth per second of move_s)
    m8, m32, p8, p32 = residuals("moves")
    probe = DeviceCalibration.model_validate({**cal, "move_s": {"value": 1.0, "source": "probe"}})
    n8, n32 = (predict(name, "moves", probe)["step"] - p["step"] for name, p in (("deep8", p8), ("deep32", p32)))
    per_move, _ = fit.residual_line(m8["step"] - p8["step"], m32["step"] - p32["step"], n8, n32)
    what = (f"residual of the simulator on SOAP runs of 16-wide MLPs of 8 and 32 layers, layer k on device k mod "
            f"{s.ranks} ({n8:.0f} and {n32:.0f} moves on the critical path; medians of {s.steps} steps)")
    cal["move_s"] = num(per_move, f"{what}: slope per move")

    # pipelines: per schedule action and per step (GPipe, 2 stages, 2 and 8 microbatches)
    m2, m8_ = raw["pipeline"]["m2"], raw["pipeline"]["m8"]
    c = current()
    p2 = predict("deep32", "pipeline", c, worst=m2["worst_rank"], microbatches=2)
    pm8 = predict("deep32", "pipeline", c, worst=m8_["worst_rank"], microbatches=8)
    action, base = fit.residual_line(m2["step"] - p2["step"], m8_["step"] - pm8["step"], 2 * (2 + 1), 2 * (8 + 1))
    what = ("residual of the simulator on GPipe runs of a 16-wide MLP of 32 layers over 2 stages with 2 and 8 "
            f"microbatches (medians of {s.steps} steps)")
    cal["pipeline_action_s"] = num(action, f"{what}: slope per forward or backward action of a stage")
    cal["step_s"]["pipeline"] = num(base, f"{what}: intercept per step (critical path of (m + p - 1) forward and "
                                          "backward actions)")
    floor("pipeline", m2, predict("deep32", "pipeline", current(), worst=m2["worst_rank"], microbatches=2),
          "GPipe run with 2 microbatches")

    # D-PSGD: the fixed cost per step (posting and waiting for the gossip, the loss all-reduce)
    m8, m32, p8, p32 = residuals("decentralized")
    r8, r32 = m8["step"] - p8["step"], m32["step"] - p32["step"]
    what = (f"residual of the simulator on D-PSGD runs of 16-wide MLPs of 8 and 32 layers ({r8 * 1e3:.2f} and "
            f"{r32 * 1e3:.2f} ms; medians of {s.steps} steps)")
    cal["step_s"]["decentralized"] = num(max(0.0, (r8 + r32) / 2), f"{what}: their mean per step")
    floor("decentralized", m8, predict("deep8", "decentralized", current(), worst=m8["worst_rank"]),
          "D-PSGD run of the 8-layer MLP")
    return current()


def step_spread(rounds: list[dict]) -> tuple[float, int]:
    """The run-to-run noise of a step: over the probe runs of every execution mode
    (:data:`MODES`), the half ranges of their step times across the repeats summed,
    over their medians summed (each run weighs by its length: the relative noise of a
    3 ms probe step says little about a 100 ms step); and how many runs."""
    half = mid = 0.0
    runs = 0
    for mode in MODES:
        for key in rounds[0][mode]:
            steps = sorted(r[mode][key]["step"] for r in rounds)
            half, mid, runs = half + (steps[-1] - steps[0]) / 2, mid + steps[len(steps) // 2], runs + 1
    return half / mid, runs


def combine_repeats(cals: list[DeviceCalibration], rounds: list[dict], where: str) -> DeviceCalibration:
    """One calibration from each repeat's (:func:`.fit.combine`), with the run-to-run
    noise of a step (:attr:`~flexsearch.cost.calibration.DeviceCalibration.step_spread`)."""
    merged = fit.combine([c.model_dump() for c in cals])
    merged["repeats"] = len(cals)
    if len(cals) > 1:
        spread, runs = step_spread(rounds)
        merged["step_spread"] = {
            "value": spread,
            "source": f"{where}; over the {runs} probe runs of {', '.join(MODES)}, the half ranges of their step "
                      f"times across {len(cals)} repeats summed over their medians summed"}
    return DeviceCalibration.model_validate(merged)


# ----------------------------------------------------------------------------- the command


@dataclass(frozen=True)
class CalibrationResult:
    path: Path
    device: str
    calibration: DeviceCalibration
    measured: tuple[str, ...]
    """Stages measured by this run, once per repeat (the others were resumed)."""
    log_path: Path
    resumed: bool = False
    """Whether some stages came from an interrupted run's progress file."""


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)  # atomic: a reader sees the old file or the new one


def calibrate(*, out: str | os.PathLike[str] | None = None, settings: Settings = Settings(),
              profile_path: str | os.PathLike[str] | None = None, restart: bool = False,
              progress: Callable[[int, int, str], None] | None = None) -> CalibrationResult:
    """Measure and write this machine's calibration (module docstring) to ``out``
    (default :func:`~flexsearch.cost.calibration.user_calibration_path`).
    ``progress(done, total, stage)`` is called before each stage; ``restart`` ignores
    a progress file from an interrupted run."""
    path = Path(out) if out is not None else user_calibration_path()
    if path.exists():
        try:
            existing = CalibrationFile.model_validate_json(path.read_text())
        except ValueError:
            raise CalibrationError(f"{path} exists and is not a calibration file; choose another --out or move "
                                   "it away (it is not overwritten)") from None
    else:
        existing = CalibrationFile()
    partial = path.with_name(path.name + ".partial.json")
    prof = Path(profile_path) if profile_path is not None else default_profile_path(settings.threads)
    key = settings.key()
    state: dict[str, Any] = {"key": key, "date": datetime.date.today().isoformat(), "load": load_average(),
                             "stages": {}}
    if partial.exists() and not restart:
        try:
            old = json.loads(partial.read_text())
        except (OSError, ValueError):
            old = None
        if isinstance(old, dict) and old.get("key") == key:
            state = old
    measured = []
    steps = [("profile", 0), *((stage, r) for r in range(settings.repeats) for stage in STAGES[1:])]
    rounds: list[dict] = state.setdefault("rounds", [{} for _ in range(settings.repeats)])
    for i, (stage, r) in enumerate(steps):
        if progress is not None:
            progress(i, len(steps), stage if settings.repeats == 1 else f"{stage} ({r + 1}/{settings.repeats})")
        done = state["stages"] if stage == "profile" else rounds[r]
        if stage in done:
            continue
        try:
            done[stage] = measure_stage(stage, settings, prof)
        except RuntimeError as e:
            raise CalibrationError(f"calibration stage {stage!r} failed ({str(e).strip().splitlines()[-1][:160]}); "
                                   "rerun `flexsearch calibrate` to resume from it") from None
        measured.append(stage)
        _write_atomic(partial, json.dumps(state, default=list) + "\n")
    if progress is not None:
        progress(len(steps), len(steps), "fitting")
    host = key["host"]
    where = (f"measured by `{settings.command}` on {state['date']}, {host['cpu']}, {host['cores']} cores, "
             f"{settings.ranks} gloo ranks x {settings.threads} threads, torch {host['torch']}, {state['load']}")
    raw = json.loads(json.dumps(rounds, default=list))  # as read back from the progress file
    cal = combine_repeats([assemble(one, settings, where, prof) for one in raw], raw, where)
    cal = cal.model_copy(
        update={"host": HostRecord(cpu=host["cpu"], cores=host["cores"], torch=host["torch"], date=state["date"])})
    device = Cluster.resolve(CLUSTER, settings.ranks).device.name
    data = CalibrationFile(
        description="Calibration of the simulator against real runs of emitted plans, per device "
                    "(flexsearch/cost/calibration.py); written by `flexsearch calibrate`.",
        command=settings.command, devices={**existing.devices, device: cal})
    _write_atomic(path, data.model_dump_json(indent=2) + "\n")
    log = path.with_name(f"{path.stem}-measurements.json")
    _write_atomic(log, json.dumps({"command": settings.command, **state}, indent=1, default=list) + "\n")
    partial.unlink(missing_ok=True)
    return CalibrationResult(path, device, cal, tuple(measured), log, resumed=len(measured) < len(steps))
