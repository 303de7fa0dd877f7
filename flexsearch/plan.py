"""A plan: the strategy the planner chose, its prediction, and what it was made for.

Plans are frozen pydantic values saved as versioned JSON (:meth:`Plan.save`,
:meth:`Plan.load`). A plan embeds the cluster spec it was planned on, so loading and
re-simulating it needs neither the cluster file nor a GPU, and the fingerprint of the
model graph, so using it with another model is a clear error (:meth:`Plan.check_graph`).
Search timing is kept off the file (``search_time_s`` is a runtime attribute): the same
seed and ``max_iters`` give the same file, byte for byte.
"""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from flexsearch.cost.calibration import within_noise
from flexsearch.cost.hardware import ClusterSpec
from flexsearch.errors import FlexsearchError, PlanFileError
from flexsearch.graph.opgraph import Constant, OpGraph, TensorMeta
from flexsearch.strategy.config import Config, legal, parse_config
from flexsearch.strategy.fsdp import fsdp_units
from flexsearch.strategy.kinds import DataParallel, Decentralized, Pipelined, Soap, Strategy

REFERENCE_BASELINES = {
    "pipedream": "asynchronous, stale weights; not emitted",
    "ps": "a parameter server; not emitted, no runtime cost per step",
    "ps-sharded": "parameter servers; not emitted, no runtime cost per step",
}
"""Baselines the emitter does not run (PipeDream's asynchronous pipeline changes the
training semantics with stale weights; parameter servers), with what the plan's table
(:func:`flexsearch.tables.plan_table`) says of each: reported for comparison, not a
bound the returned plan must beat. A parameter server's prediction has no runtime cost
per step (``step_s``), which a calibrated cluster gives every plan the emitter runs,
so there it can look faster than the plan."""

PLAN_VERSION = 7
"""7: ``shard: zero2`` on pipeline plans (FSDP2 stages over their replicas), and
``microbatches`` on ``zero1`` and ``zero2`` data-parallel plans (accumulation); 6: ``shard: zero1`` on pipeline and hybrid plans (optimizer state sharded over a
stage's replicas); 5: the sharding of a data-parallel plan (``shard``: ``none``, ``zero1``, ``zero2``,
``zero3``, ``hsdp``, with ``shard_group``; was ``shard_params``, true reads as ``zero3``); 4: the training precision and model FLOPs, recompute modes (``none``, ``selective``,
``full``), gradient accumulation for data-parallel plans; 3: the FSDP units of a sharded data-parallel plan; 2: search curve, notes,
decentralized topology fields (files of versions 1 to 3 still load)."""
PlanKind = Literal["data", "soap", "pipeline", "hybrid", "decentralized"]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Predicted(_Frozen):
    """The simulator's prediction for one iteration."""

    iteration_time_s: float
    peak_memory_bytes: float
    memory_bytes: tuple[float, ...] = ()
    """Per device."""
    compute_s: tuple[float, ...] = ()
    """Busy compute time per device."""


class Stage(_Frozen):
    """One pipeline stage (pipeline and hybrid plans)."""

    nodes: tuple[str, ...]
    devices: tuple[int, ...]
    replicas: int = 1


class SearchInfo(_Frozen):
    """How the plan was searched (no timings: they are not reproducible)."""

    seed: int = 0
    max_iters: int | None = None
    budget_s: float | None = None
    iterations: int = 0
    ilp: str = "skipped"
    """ILP status: optimal, feasible, infeasible, or why it was skipped."""
    curve: tuple[tuple[int, float], ...] = ()
    """The search's convergence: (iteration, best predicted iteration time in s) at
    every improvement of the MCMC search (iteration 0: the best seed)."""


class Plan(_Frozen):
    """A parallelization plan (DESIGN section 1)."""

    version: int = PLAN_VERSION
    model: str
    graph_fingerprint: str
    kind: PlanKind
    devices: int = Field(ge=1)
    cluster: ClusterSpec
    optimizer: str = "adam"
    objective: Literal["iteration", "time_to_accuracy"] = "iteration"
    precision: Literal["fp32", "tf32", "bf16-mixed", "fp16-mixed", "bf16"] = "fp32"
    """The training precision the plan was searched and is run in (:mod:`flexsearch.precision`)."""
    predicted: Predicted
    lower_bound_s: float
    model_flops: float = 0.0
    """FLOPs of one iteration of the model (forward and backward, counted by the tracer;
    0 in files older than version 3)."""
    baselines: dict[str, float]
    """Baseline name -> predicted iteration time (s); only baselines that fit in memory."""
    noise: float | None = Field(default=None, ge=0)
    """Run-to-run spread of a measured step, as a fraction, from the calibration the plan
    was costed with (:attr:`flexsearch.cost.calibration.DeviceCalibration.step_spread`):
    predictions closer than this cannot be told apart by measuring them. None: costed
    without a calibration measured more than once."""
    infeasible_baselines: tuple[str, ...] = ()
    """Baselines that do not fit in memory."""
    decisions: dict[str, str] = {}
    """Decision unit (its first node) -> configuration text."""
    configs: dict[str, str] = {}
    """Every node -> configuration text (decisions expanded to followers)."""
    stages: tuple[Stage, ...] = ()
    schedule: str | None = None
    microbatches: int | None = None
    chunks: int | None = None
    """Model chunks per pipeline rank (interleaved 1F1B); stage k runs on rank k mod (stages / chunks)."""
    recompute: Literal["none", "selective", "full"] = "none"
    """Activation checkpointing of the plan's units (:mod:`flexsearch.strategy.recompute`;
    ``true`` in a version 1-2 file, when a pipeline stage was recomputed whole, reads as
    ``full``)."""
    batch_norm: Literal["local", "sync"] = "local"
    """Batch statistics of BatchNorm layers: ``local``, each replica's own samples (per
    microbatch in a pipeline or under accumulation), as DDP computes them; ``sync``,
    SyncBatchNorm over the data-parallel replicas (GPUs only)."""
    shard: Literal["none", "zero1", "zero2", "zero3", "hsdp"] = "none"
    """How a data-parallel plan shards its training state over the devices
    (:data:`flexsearch.strategy.kinds.SHARDINGS`): replicated (DDP), ZeRO-1 (DDP and
    ``ZeroRedundancyOptimizer``), ZeRO-2/ZeRO-3 (FSDP2 ``fully_shard`` without/with
    ``reshard_after_forward``), or HSDP (FSDP2 on a ``(replicate, shard)`` mesh). A
    pipeline or hybrid plan: ``none``, ``zero1``, its optimizer state sharded over
    each stage's replicas, or ``zero2``, each stage an
    FSDP2 module over its replicas (:data:`flexsearch.strategy.kinds.PIPELINE_SHARDINGS`)."""
    shard_group: int | None = None
    """``hsdp`` plans: devices per shard group (consecutive devices)."""
    fsdp_units: tuple[str, ...] = ()
    """FSDP-sharded data-parallel plans: the module paths wrapped as FSDP units
    (:mod:`flexsearch.strategy.fsdp`), decided once for the simulator and the emitter."""
    inputs: tuple[TensorMeta, ...] = ()
    input_names: tuple[str, ...] = ()
    """Per input, the keyword the model takes it by (``""`` or absent: positional)."""
    constant_inputs: tuple[tuple[str, Constant], ...] = ()
    """The keyword inputs that are not tensors (``return_loss=True``), as traced: the
    emitter traces the model with them again."""
    """The model's example inputs (positional), so the emitter can re-trace the model
    and check it is the one the plan was made for."""
    topology: str | None = None
    """Decentralized plans: the gossip topology's name (:mod:`flexsearch.strategy.topology`)."""
    topology_edges: tuple[tuple[int, int], ...] = ()
    """Decentralized plans with a custom topology: its edges (rank pairs)."""
    spectral_gap: float | None = None
    """Decentralized plans: ``1 - beta`` of the mixing matrix (REFERENCE section 3)."""
    iterations_factor: float | None = None
    """Decentralized plans: iterations to reach the same accuracy as synchronous SGD,
    relative to it (>= 1; the time-to-accuracy model of :mod:`flexsearch.strategy.topology`)."""
    search: SearchInfo = SearchInfo()
    notes: tuple[str, ...] = ()
    """Why the planner chose this plan over others it considered (one line each)."""

    _search_time_s: float | None = PrivateAttr(default=None)
    _interrupted: bool = PrivateAttr(default=False)

    @property
    def interrupted(self) -> bool:
        """The search was stopped by Ctrl-C: the best plan found so far (not saved)."""
        return self._interrupted

    @property
    def search_time_s(self) -> float | None:
        """Wall time of the search that made this plan (not saved)."""
        return self._search_time_s

    @model_validator(mode="before")
    @classmethod
    def _old_fields(cls, data):
        if isinstance(data, dict) and isinstance(data.get("recompute"), bool):
            data = {**data, "recompute": "full" if data["recompute"] else "none"}
        if isinstance(data, dict) and "shard_params" in data:  # version 4 and older: a bool, true for FSDP
            old = data["shard_params"]
            data = {k: v for k, v in data.items() if k != "shard_params"}
            data.setdefault("shard", {True: "zero3", False: "none"}.get(old, old) if isinstance(old, bool) else old)
        return data

    @property
    def shard_params(self) -> bool:
        """Are the parameters sharded at rest (FSDP2: ``zero2``, ``zero3``, ``hsdp``)?"""
        return self.shard in ("zero2", "zero3", "hsdp")

    @model_validator(mode="after")
    def _decentralized_fields(self) -> Plan:
        if self.kind == "decentralized" and self.topology is None:
            raise ValueError("a decentralized plan needs a topology")
        return self

    def __eq__(self, other: object) -> bool:
        """Plans are equal when their saved content is (the search time is not part of it)."""
        if not isinstance(other, Plan):
            return NotImplemented
        return self.model_dump() == other.model_dump()

    __hash__ = None  # type: ignore[assignment]  # dict fields: plans are not hashable

    def with_search_time(self, seconds: float) -> Plan:
        self._search_time_s = seconds
        return self

    def with_interrupted(self) -> Plan:
        """Mark the plan as the best found before the search was stopped (not saved)."""
        self._interrupted = True
        return self

    @property
    def mfu(self) -> float | None:
        """Model FLOP/s utilisation: the model's FLOPs per iteration over what the
        devices' peak (in the precision's matmul dtype) could do in the predicted time."""
        from flexsearch.precision import precision as precision_of

        if not self.model_flops or not self.predicted.iteration_time_s:
            return None
        p = precision_of(self.precision)
        peak = self.cluster.device.peak("tf32" if p.tf32 else p.low)
        return self.model_flops / (self.predicted.iteration_time_s * self.devices * peak)

    @property
    def speedup_over_data(self) -> float | None:
        dp = self.baselines.get("data")
        return dp / self.predicted.iteration_time_s if dp else None

    @property
    def within_noise(self) -> tuple[str, ...]:
        """Baselines whose prediction differs from the plan's by less than :attr:`noise`
        of the faster of the two: measuring could rank them either way."""
        t = self.predicted.iteration_time_s
        return tuple(k for k, b in sorted(self.baselines.items()) if within_noise(b, t, self.noise))

    def node_configs(self) -> dict[str, Config]:
        return {k: parse_config(v) for k, v in self.configs.items()}

    @property
    def tensor_degree(self) -> int:
        """The largest model-split degree of any op (a hybrid plan's tensor-parallel degree)."""
        return max((c.t for c in self.node_configs().values()), default=1)

    def decision_configs(self) -> dict[str, Config]:
        return {k: parse_config(v) for k, v in self.decisions.items()}

    def strategy(self, graph: OpGraph) -> Strategy:
        """The plan as a strategy value for ``graph`` (made for it: checked), what the
        simulator predicts; raises PlanFileError when the file's strategy does not fit
        the graph (damaged or edited)."""
        self.check_graph(graph)
        if self.kind == "decentralized":
            from flexsearch.strategy.topology import build

            try:
                return Decentralized(build(self.topology or "", self.devices, edges=self.topology_edges or None))
            except (FlexsearchError, ValueError) as e:
                raise PlanFileError(f"the decentralized plan cannot be simulated: {e}; plan again") from None
        if self.kind in ("pipeline", "hybrid"):
            if self.schedule == "pipedream":
                raise PlanFileError("PipeDream's asynchronous plans are baselines, not plans flexsearch returns")
            flat = [n for st in self.stages for n in st.nodes]
            if flat != [n.name for n in graph.nodes] or not self.schedule or not self.microbatches:
                raise PlanFileError("the plan's stages do not cover the model's nodes in order; plan again")
            ends = list(itertools.accumulate(len(st.nodes) for st in self.stages))
            bounds = tuple(zip([0, *ends[:-1]], ends, strict=True))
            try:
                return Pipelined(bounds, self.tensor_degree, self.stages[0].replicas, self.schedule,
                                 self.microbatches, self.chunks or 1, self.recompute, self.shard)
            except ValueError as e:
                raise PlanFileError(f"the plan's pipeline cannot be simulated: {e}; plan again") from None
        configs = self.node_configs()
        missing = [n.name for n in graph.nodes if n.name not in configs]
        missing += [k for k in self.decisions if k not in configs]
        if missing:
            raise PlanFileError(f"the plan has no configuration for {missing[0]}; plan this model again")
        names = {n.name for n in graph.nodes}
        extra = [k for k in configs if k not in names]  # a decision outside configs is missing, above
        if extra:
            raise PlanFileError(f"the plan configures {extra[0]}, which is not an op of the model; the file is "
                                "damaged or edited, plan again")
        for n in graph.nodes:  # decisions and followers alike: the emitter must be able to run them
            if not legal(n, configs[n.name], self.devices):
                raise PlanFileError(
                    f"the plan's configuration {configs[n.name].text} for {n.name} is not legal on "
                    f"{self.devices} devices; the file is damaged or edited, plan again"
                )
        decisions = self.decision_configs()
        if self.kind == "soap":
            try:
                return Soap(configs, decisions, self.recompute)
            except ValueError as e:
                raise PlanFileError(f"the plan's SOAP configuration cannot be simulated: {e}; plan again") from None
        units = self.fsdp_units or (fsdp_units(graph.modules) if self.shard_params else ())
        try:
            return DataParallel(configs, decisions, shard=self.shard, fsdp_units=units,
                                shard_group=self.shard_group or 0, microbatches=self.microbatches or 1,
                                recompute=self.recompute)
        except ValueError as e:
            raise PlanFileError(f"the plan's data parallelism cannot be simulated: {e}; plan again") from None

    def check_graph(self, graph: OpGraph) -> None:
        """Raise PlanFileError unless this plan was made for ``graph`` (the same model,
        traced in the plan's precision)."""
        if graph.fingerprint != self.graph_fingerprint:
            if graph.model == self.model:
                raise PlanFileError(
                    f"model {self.model!r} now traces to graph {graph.fingerprint}, not the plan's "
                    f"{self.graph_fingerprint}: it changed since the plan was made (or the plan was edited); plan "
                    "it again with `flexsearch plan`")
            raise PlanFileError(
                f"this plan was made for model {self.model!r} (graph {self.graph_fingerprint}), "
                f"not for {graph.model!r} (graph {graph.fingerprint}); plan this model with "
                "`flexsearch plan`"
            )
        if graph.precision != self.precision:
            raise PlanFileError(
                f"this plan is for {self.precision} training but the graph was traced in {graph.precision}; "
                f"trace the model with precision={self.precision!r}"
            )

    def to_json(self) -> str:
        return self.model_dump_json(indent=2) + "\n"

    def save(self, path: str | os.PathLike[str], *, overwrite: bool = True) -> None:
        p = Path(path)
        if p.exists() and not overwrite:
            raise PlanFileError(f"{p} exists; choose another --out path or remove it first")
        p.write_text(self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Plan:
        p = Path(path)
        try:
            text = p.read_text()
        except FileNotFoundError:
            raise PlanFileError(f"plan file {p} does not exist; write one with `flexsearch plan ... --out {p}`") from None
        except (OSError, UnicodeDecodeError) as e:
            raise PlanFileError(f"cannot read plan file {p}: {e}") from None
        return cls.from_json(text, where=str(p))

    @classmethod
    def from_json(cls, text: str, *, where: str = "plan") -> Plan:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlanFileError(
                f"{where} is not valid JSON (line {e.lineno}: {e.msg}): not a plan file, or a damaged one; "
                "pass a file written by `flexsearch plan --out`, or plan again"
            ) from None
        if not isinstance(raw, dict) or "version" not in raw:
            raise PlanFileError(f"{where} is not a flexsearch plan (no version field)")
        v = raw["version"]
        if not isinstance(v, int) or v > PLAN_VERSION:
            raise PlanFileError(
                f"{where} has plan version {v!r}, newer than this flexsearch reads "
                f"({PLAN_VERSION}); upgrade flexsearch"
            )
        try:
            plan = cls.model_validate(raw)
        except ValidationError as e:
            err = e.errors()[0]
            loc = ".".join(str(x) for x in err["loc"])
            raise PlanFileError(f"{where} is damaged: {loc}: {err['msg']}; plan again") from None
        for table in (plan.decisions, plan.configs):
            for name, text_ in table.items():
                try:
                    c = parse_config(text_)
                except ValueError as e:
                    raise PlanFileError(f"{where} is damaged: {name}: {e}") from None
                if c.first + c.n > plan.devices:
                    raise PlanFileError(f"{where} is damaged or edited: {name}'s configuration {text_} uses "
                                        f"{c.first + c.n} devices, the plan {plan.devices}; plan again")
        return plan
