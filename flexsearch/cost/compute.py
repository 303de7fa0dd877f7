"""Compute cost of one operator (or one partition of it) on one device: a roofline,
overridden by measured times when a lookup has them.

Roofline, for the forward and for the backward pass separately::

    time = max( flops / (peak[dtype] * eff_flops[kind]),
                bytes / (memory_bandwidth * eff_bw[kind]) )

with ``peak``/``memory_bandwidth`` from the device spec and the efficiency factors from
``costmodels/efficiency.json`` (:mod:`flexsearch.cost.efficiency`).

**Partition rule.** A :class:`Partition` gives the op's degrees along the SOAP
dimensions: ``sample`` (batch), ``attribute`` (other non-parameter output dims),
``parameter`` (output dims that index the parameters) and ``reduce`` (a summed input
dim, leaving partial sums). One task of the partition does::

    params read    = min(param_bytes, bytes_read)
    flops          = node.flops / (sample * attribute * parameter * reduce)
    activations in = (bytes_read - params read) / (sample * attribute * reduce)
    parameters     = params read / (parameter * reduce)
    output         = bytes_written / (sample * attribute * parameter)
    bytes          = activations in + parameters + output

(``node.bytes_read`` includes the parameter bytes the op reads: all of its weights for
a layer, only the gathered rows for a lookup, hence the ``min``. A partial-sum output
is full size along the reduced dim, so ``reduce`` does not divide it.)

**Backward rule.** ``flops = node.backward_flops / (product of degrees)``;
``bytes = 2 x forward bytes`` of the task: the backward reads the output gradient and
the saved inputs and parameters, and writes the input and parameter gradients.

Placeholder nodes (``input``, ``output``, ``param``) cost 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Protocol

from flexsearch.cost.efficiency import EfficiencyTable, load_efficiency
from flexsearch.cost.hardware import DeviceSpec
from flexsearch.graph.opgraph import OpNode

FREE_KINDS = frozenset({"input", "output", "param"})
_FLOAT_DTYPES = frozenset({"float64", "float32", "float16", "bfloat16", "tf32"})


@dataclass(frozen=True)
class Partition:
    """Degrees of one op's partition along sample, attribute, parameter and reduce
    dimensions; ``tasks`` = their product. All default to 1 (the whole op)."""

    sample: int = 1
    attribute: int = 1
    parameter: int = 1
    reduce: int = 1

    def __post_init__(self) -> None:
        for name in ("sample", "attribute", "parameter", "reduce"):
            d = getattr(self, name)
            if isinstance(d, bool) or not isinstance(d, int) or d < 1:
                raise ValueError(f"partition degree {name} must be an integer >= 1 (got {d!r})")

    @property
    def tasks(self) -> int:
        return self.sample * self.attribute * self.parameter * self.reduce


WHOLE = Partition()


@dataclass(frozen=True)
class Work:
    """What one task does: FLOPs and bytes moved to/from device memory."""

    flops: float
    bytes: float


@dataclass(frozen=True)
class OpCost:
    """Forward and backward time of one task; ``source`` says where they come from."""

    forward_s: float
    backward_s: float
    source: Literal["roofline", "measured", "free"]

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s


class MeasuredCosts(Protocol):
    """Measured per-op times (written by the profiler). ``lookup`` returns
    ``(forward_s, backward_s)`` for one task of ``partition`` of ``node`` on the device
    named ``device_name`` in ``dtype``, or None when it has no measurement. An optional
    ``estimate`` method (same arguments) derives a partition it has not measured from
    the ones it has (:meth:`flexsearch.cost.profiler.ProfileDB.estimate`); it is asked
    before falling back to the roofline."""

    def lookup(
        self, node: OpNode, partition: Partition, device_name: str, dtype: str
    ) -> tuple[float, float] | None: ...


def forward_work(node: OpNode, partition: Partition = WHOLE) -> Work:
    """FLOPs and bytes of one forward task (partition rule in the module docstring)."""
    p = partition
    params = min(node.param_bytes, node.bytes_read)
    nbytes = (
        (node.bytes_read - params) / (p.sample * p.attribute * p.reduce)
        + params / (p.parameter * p.reduce)
        + node.bytes_written / (p.sample * p.attribute * p.parameter)
    )
    return Work(node.flops / p.tasks, nbytes)


def backward_work(node: OpNode, partition: Partition = WHOLE) -> Work:
    """FLOPs and bytes of one backward task: ``backward_flops / tasks``, 2x forward bytes."""
    return Work(node.backward_flops / partition.tasks, 2 * forward_work(node, partition).bytes)


def node_dtype(node: OpNode) -> str:
    """The dtype an op computes in: its first floating-point output's, else float32."""
    for t in node.outputs:
        if t.dtype in _FLOAT_DTYPES:
            return t.dtype
    return "float32"


def roofline_time(
    work: Work, device: DeviceSpec, dtype: str, kind: str, efficiency: EfficiencyTable | None = None
) -> float:
    """``max(flops / (peak[dtype] * eff_flops[kind]), bytes / (bw * eff_bw[kind]))``."""
    table = efficiency if efficiency is not None else load_efficiency()
    eff_f, eff_b = table.factors(kind, device.name)
    compute = work.flops / (device.peak(dtype) * eff_f) if work.flops else 0.0
    memory = work.bytes / (device.memory_bandwidth.value * eff_b) if work.bytes else 0.0
    return max(compute, memory)


def op_cost(
    node: OpNode,
    device: DeviceSpec,
    partition: Partition = WHOLE,
    *,
    dtype: str | None = None,
    efficiency: EfficiencyTable | None = None,
    measured: MeasuredCosts | None = None,
) -> OpCost:
    """Forward and backward time of one task of ``partition`` of ``node`` on ``device``.

    ``dtype`` defaults to :func:`node_dtype` (pass ``"tf32"`` to model TF32 matmuls).
    A ``measured`` lookup that has the op wins over the roofline."""
    if node.kind in FREE_KINDS:
        return OpCost(0.0, 0.0, "free")
    dt = dtype or node_dtype(node)
    if measured is not None:
        hit = measured.lookup(node, partition, device.name, dt)
        if hit is None and hasattr(measured, "estimate"):
            hit = measured.estimate(node, partition, device.name, dt)
        if hit is not None:
            fwd, bwd = hit
            if not (math.isfinite(fwd) and math.isfinite(bwd) and fwd >= 0 and bwd >= 0):
                raise ValueError(f"measured time for {node.name} must be finite and >= 0 (got {hit!r})")
            return OpCost(float(fwd), float(bwd), "measured")
    fwd = roofline_time(forward_work(node, partition), device, dt, node.kind, efficiency)
    bwd = roofline_time(backward_work(node, partition), device, dt, node.kind, efficiency)
    return OpCost(fwd, bwd, "roofline")
