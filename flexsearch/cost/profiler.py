"""The op profiler: measure each op's forward and backward time on the local device, at
its full shape and at the partitioned shapes the search may ask for, and cache them.

**What is measured.** Every distinct op of the graph (identical layers share one
``OpNode.signature``, so a 96-layer transformer is measured once per distinct op) is
run alone on real tensors of its input shapes: forward time, then the time of
``torch.autograd.grad`` of its outputs w.r.t. its float inputs and parameters
(:func:`flexsearch.cost.op_timing.measure_call`). On a GPU with CUDA events; on a CPU
with ``time.perf_counter`` and a fixed thread count. Each after ``warmup`` runs, the
median of ``repeats`` (the backward: of whole rounds of copies, at least ``repeats``),
every timed call on operands out of the cache (copies used in turn, the inputs just
written), as in a training step.

**Partitions** (:func:`partitions_of`): the whole op, and degrees 2, 4, 8 along each
SOAP role the node has: ``sample`` divides the batch dim of every activation input;
``attribute`` divides the input dim aligned (from the right) with the node's first
attribute output dim; ``parameter`` divides the parameter dim that indexes the output
(dim 0 of Linear/Conv weights and biases, dim 1 of embedding tables; for BatchNorm the
channel of the input too); ``reduce`` divides the summed dim (in_features of a Linear
and dim 1 of its weight, in_channels of a Conv, embedding rows, ``k`` of a matmul).

**Cache.** ``profiles/<device>.json`` (:class:`ProfileFile`, pydantic), one entry per
key ``signature|partition|dtype|device|torch-<version>`` (DESIGN section 4). The file is
rewritten atomically every few seconds and when the run ends or is interrupted, so an
interrupted run keeps what it measured and the next run resumes where it stopped.
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, ValidationError
from torch.utils._pytree import tree_map

from flexsearch.cost.compute import Partition, node_dtype
from flexsearch.cost.op_timing import call_bytes, measure_call
from flexsearch.errors import ProfileError
from flexsearch.graph.calls import ArgTensor, OpCall
from flexsearch.graph.opgraph import OpGraph, OpNode
from flexsearch.graph.tracer import trace_calls
from flexsearch.precision import FP32, TF32
from flexsearch.precision import precision as precision_of

PROFILE_VERSION = 2
"""2: ops timed on operands out of the cache (:func:`measure_call`); a profile of an older
version is re-measured whole, not resumed, by :func:`profile_model`."""
DEGREES = (2, 4, 8)
SKIP_KINDS = frozenset({"input", "output", "param"})


class ProfileEntry(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    forward_s: float
    backward_s: float
    repeats: int
    target: str = ""
    node_bytes: int | None = None
    """``bytes_written`` of the whole (unpartitioned) node that was measured: tells a
    microbatch copy of the node (same signature, batch divided by ``k``) from it."""


class ProfileFile(BaseModel):
    """A cache of measured op times for one device."""

    model_config = ConfigDict(extra="forbid")

    version: int = PROFILE_VERSION
    device: str
    host: dict[str, Any] | None = None
    """The machine that measured the entries (:func:`host_info`; None: not recorded).
    Op times do not travel between machines: a caller that cares compares it with
    this host's."""
    entries: dict[str, ProfileEntry] = {}


def local_device(threads: int | None = None) -> str:
    """Name of this process's device: the CUDA device's name, else ``cpu-<N>t`` with the
    torch thread count (CPU times depend on it)."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_name().replace(" ", "-")
    return f"cpu-{threads or torch.get_num_threads()}t"


def partition_text(p: Partition) -> str:
    return f"s{p.sample}a{p.attribute}p{p.parameter}r{p.reduce}"


def profile_key(node: OpNode, partition: Partition, dtype: str, device: str, torch_version: str | None = None) -> str:
    """The cache key: (op signature, partition, dtype, device, torch version)."""
    version = torch_version or torch.__version__
    return f"{node.signature}|{partition_text(partition)}|{dtype}|{device}|torch-{version}"


def _looks_like_profile(text: str) -> bool:
    """Is ``text`` a JSON object with a profile's own fields (``device`` and ``entries``):
    a profile, damaged or not, rather than some other file?"""
    try:
        raw = json.loads(text)
    except ValueError:
        return False
    return isinstance(raw, dict) and "device" in raw and "entries" in raw


class ProfileDB:
    """Measured times loaded from a profile file; a ``MeasuredCosts`` for the cost model."""

    def __init__(self, data: ProfileFile, path: Path | None = None) -> None:
        self.data = data
        self.path = path

    @classmethod
    def load(cls, path: str | Path, device: str | None = None) -> ProfileDB:
        path = Path(path)
        if not path.exists():
            return cls(ProfileFile(device=device or path.stem), path)
        try:
            text = path.read_text()
        except UnicodeDecodeError:  # a binary file: not a profile
            text = ""
        try:
            data = ProfileFile.model_validate_json(text)
        except (ValidationError, ValueError) as exc:
            if not _looks_like_profile(text):
                raise ProfileError(f"{path} exists and is not a profile file; pass a profile written by `flexsearch "
                                   "profile`, or choose another --out (it is not overwritten)") from exc
            first = str(exc).splitlines()[0]
            raise ProfileError(f"profile {path} is damaged ({first}); delete it and run `flexsearch profile` again") from exc
        if data.version > PROFILE_VERSION:
            raise ProfileError(f"profile {path} has version {data.version}, newer than this flexsearch ({PROFILE_VERSION}); upgrade flexsearch")
        if device is not None and data.device != device:
            raise ProfileError(f"profile {path} is for device {data.device!r}, not {device!r}; pass the matching --out file")
        return cls(data, path)

    def save(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        tmp.write_text(self.data.model_dump_json(indent=1))
        os.replace(tmp, self.path)

    def get(self, key: str) -> ProfileEntry | None:
        return self.data.entries.get(key)

    def put(self, key: str, entry: ProfileEntry) -> None:
        self.data.entries[key] = entry

    def lookup(self, node: OpNode, partition: Partition, device_name: str, dtype: str) -> tuple[float, float] | None:
        """``(forward_s, backward_s)`` measured for this node and partition, or None.

        A node of a microbatch graph (:func:`flexsearch.graph.microbatch.microbatch_graph`:
        same signature, the batch divided by ``k``) is the whole node's sample split
        ``k``: it is looked up as ``sample * k``."""
        k = self._microbatch_factor(node, device_name, dtype)
        if k > 1:
            partition = replace(partition, sample=partition.sample * k)
        entry = self.data.entries.get(profile_key(node, partition, dtype, device_name))
        return None if entry is None else (entry.forward_s, entry.backward_s)

    def estimate(self, node: OpNode, partition: Partition, device_name: str, dtype: str) -> tuple[float, float] | None:
        """For a partition :meth:`lookup` does not have (several roles at once, a degree
        the profiler did not measure): the whole op's time scaled, role by role, by its
        measured single-role ratio; beyond the largest measured degree of a role, the
        affine fit ``t(d) = a + b / d`` through its two largest measured degrees (a fixed
        per-call part and a part that shrinks with the split). None without the whole
        op's measurement."""
        k = self._microbatch_factor(node, device_name, dtype)
        if k > 1:
            partition = replace(partition, sample=partition.sample * k)
        return self._composed(node, partition, device_name, dtype)

    def _microbatch_factor(self, node: OpNode, device_name: str, dtype: str) -> int:
        whole = self.data.entries.get(profile_key(node, Partition(), dtype, device_name))
        if whole is None or not whole.node_bytes or not node.bytes_written:
            return 1
        if whole.node_bytes == node.bytes_written or whole.node_bytes % node.bytes_written:
            return 1
        return whole.node_bytes // node.bytes_written

    def _composed(self, node: OpNode, partition: Partition, device_name: str, dtype: str) -> tuple[float, float] | None:
        whole = self.data.entries.get(profile_key(node, Partition(), dtype, device_name))
        if whole is None:
            return None
        fwd, bwd = whole.forward_s, whole.backward_s
        for role in ("sample", "attribute", "parameter", "reduce"):
            d = getattr(partition, role)
            if d == 1:
                continue
            f = self._role_time(node, role, d, device_name, dtype, whole)
            if f is None:
                return None
            fwd = fwd * f[0] / whole.forward_s if whole.forward_s > 0 else f[0]
            bwd = bwd * f[1] / whole.backward_s if whole.backward_s > 0 else f[1]
        return fwd, bwd

    def _role_time(self, node: OpNode, role: str, d: int, device_name: str, dtype: str,
                   whole: ProfileEntry) -> tuple[float, float] | None:
        """Time of the single-role split ``d``: measured, else the affine fit
        ``t(x) = a + b / x`` through the two largest measured degrees below ``d``
        (a fixed per-call part and a part that shrinks with the split)."""
        measured = {1: (whole.forward_s, whole.backward_s)}
        for e_key, q in ((profile_key(node, Partition(**{role: q}), dtype, device_name), q)
                         for q in range(2, d + 1)):
            e = self.data.entries.get(e_key)
            if e is not None:
                measured[q] = (e.forward_s, e.backward_s)
        if d in measured:
            return measured[d]
        if len(measured) < 2:
            return None
        q1, q2 = sorted(measured)[-2:]
        out = []
        for i in (0, 1):
            t1, t2 = measured[q1][i], measured[q2][i]
            b = (t1 - t2) / (1 / q1 - 1 / q2)
            a = t2 - b / q2
            out.append(max(0.0, a) + max(0.0, b) / d if b > 0 else t2)
        return out[0], out[1]

    def aliased(self, device_name: str) -> _Aliased:
        """This profile answering for the cluster device named ``device_name`` (a
        cluster preset names its device, e.g. ``cpu-x86-2core-process``; the profiler
        names the local one it measured, e.g. ``cpu-1t``: the ``cpu`` preset's devices
        are this machine's one-thread processes)."""
        return _Aliased(self, device_name)

    def __len__(self) -> int:
        return len(self.data.entries)


class _Aliased:
    """A :class:`ProfileDB` that answers for another device name (:meth:`ProfileDB.aliased`)."""

    def __init__(self, db: ProfileDB, device_name: str) -> None:
        self.db, self.device_name = db, device_name

    def _name(self, device_name: str) -> str:
        return self.db.data.device if device_name == self.device_name else device_name

    def lookup(self, node: OpNode, partition: Partition, device_name: str, dtype: str) -> tuple[float, float] | None:
        return self.db.lookup(node, partition, self._name(device_name), dtype)

    def estimate(self, node: OpNode, partition: Partition, device_name: str, dtype: str) -> tuple[float, float] | None:
        return self.db.estimate(node, partition, self._name(device_name), dtype)


# ----------------------------------------------------------------------------- partitions


def partitions_of(node: OpNode, degrees: Iterable[int] = DEGREES) -> list[Partition]:
    """The whole op and each single-role split the search may ask for."""
    out = [Partition()]
    roles = {d.kind for d in node.dims.output}
    for role in ("sample", "attribute", "parameter"):
        if role not in roles:
            continue
        size = min(d.size for d in node.dims.output if d.kind == role)
        out += [Partition(**{role: k}) for k in degrees if k <= size]
    if node.dims.reduced:
        size = node.dims.reduced[0].size
        out += [Partition(reduce=k) for k in degrees if k <= size]
    return out


def _split(shape: tuple[int, ...], dim: int | None, k: int) -> tuple[int, ...]:
    if dim is None or k == 1 or not shape:
        return shape
    dim %= len(shape)
    s = list(shape)
    s[dim] = max(1, math.ceil(s[dim] / k))
    return tuple(s)


def partitioned_call(node: OpNode, call: OpCall, p: Partition) -> OpCall:
    """The call one task of partition ``p`` makes: every argument shrunk per the rules
    in the module docstring."""
    out_nd = len(node.outputs[0].shape) if node.outputs else 0
    attr = next((d for d in node.dims.output if d.kind == "attribute"), None)
    kind = node.kind

    def act(t: ArgTensor, position: int) -> ArgTensor:
        shape = _split(t.shape, t.batch, p.sample)
        if attr is not None and p.attribute > 1:
            d = attr.dim - (out_nd - len(shape))
            if 0 <= d < len(shape) and shape[d] == attr.size and d != t.batch:
                shape = _split(shape, d, p.attribute)
        if p.reduce > 1:
            if kind == "linear":
                shape = _split(shape, -1, p.reduce)
            elif kind == "conv":
                shape = _split(shape, 1, p.reduce)
            elif kind == "matmul":
                shape = _split(shape, -1 if position == 0 else -2, p.reduce)
            elif node.dims.over_samples:
                shape = _split(shape, t.batch, p.reduce)
        if p.parameter > 1 and kind == "norm" and len(shape) > 1:
            shape = _split(shape, 1, p.parameter)
        return ArgTensor(shape, t.dtype, t.batch, t.state, t.grad)

    def param_shape(shape: tuple[int, ...], name: str) -> tuple[int, ...]:
        weight = name.endswith("weight")
        if p.parameter > 1:
            shape = _split(shape, 1 if kind == "embedding" else 0, p.parameter)
        if p.reduce > 1 and weight and len(shape) >= 2:
            shape = _split(shape, 0 if kind == "embedding" else 1, p.reduce)
        return shape

    position = iter(range(1_000_000))

    def shrink(x: Any) -> Any:
        if not isinstance(x, ArgTensor):
            return x
        if x.state is not None:
            return ArgTensor(param_shape(x.shape, x.state), x.dtype, None, x.state)
        return act(x, next(position))

    args, kwargs = tree_map(shrink, (call.args, call.kwargs))
    state = tuple(
        (local, param_shape(shape, local) if shape else shape, dtype, grad)
        for local, shape, dtype, grad in call.module_state
    )
    return replace(call, args=tuple(args), kwargs=dict(kwargs), module_state=state)


# ----------------------------------------------------------------------------- measuring


LEAF = "|leaf"
"""Signature suffix of an op measured as the model's first layer: its inputs are the
model's inputs, which need no gradient (the backward computes the parameters' only)."""


def leaf_node(node: OpNode) -> OpNode:
    """``node`` as a first layer (:data:`LEAF`): its measurements are keyed apart."""
    return node.model_copy(update={"signature": node.signature + LEAF})


def profile_graph(
    graph: OpGraph,
    calls: dict[str, OpCall],
    db: ProfileDB,
    *,
    device: torch.device | str = "cpu",
    device_name: str | None = None,
    degrees: Iterable[int] = DEGREES,
    warmup: int = 2,
    repeats: int = 5,
    max_bytes: int = 2 << 30,
    progress: Callable[[int, int, str], None] | None = None,
    autocast: str | None = None,
    tf32: bool = False,
) -> dict[str, int]:
    """Measure every distinct (op, partition) not yet in ``db``; save after each.
    ``autocast``: the graph was traced under ``torch.autocast`` of this dtype (mixed
    precision), and its ops run under it (:func:`measure_call`); keys carry each
    node's dtype as traced, so a lowered op's entry is not its fp32 one. ``tf32``: the
    fp32 matmul-class ops run on TF32 (the caller enables it) and are keyed ``tf32``,
    as the cost model looks them up (:meth:`flexsearch.precision.Precision.priced_dtype`).

    Returns counts: ``measured``, ``cached`` (hits), ``skipped`` (over ``max_bytes`` of
    tensors, or an op that cannot run alone).
    """
    name = device_name or local_device()
    todo: list[tuple[str, OpNode, Partition, bool]] = []
    seen: set[str] = set()
    for node in graph.nodes:
        if node.kind in SKIP_KINDS or node.name not in calls or (node.bytes_read == 0 and node.flops == 0):
            continue
        variants = [(node, True)]
        if is_first_layer(graph, node):
            variants.append((leaf_node(node), False))
        for keyed, input_grads in variants:
            dtype = (TF32 if tf32 else FP32).priced_dtype(node.kind, node_dtype(node))
            for p in partitions_of(node, degrees):
                key = profile_key(keyed, p, dtype, name)
                if key not in seen:
                    seen.add(key)
                    todo.append((key, node, p, input_grads))
    counts = {"measured": 0, "cached": 0, "skipped": 0}
    last_save = time.monotonic()
    try:
        for i, (key, node, p, input_grads) in enumerate(todo):
            if progress is not None:
                progress(i, len(todo), f"{node.name} {partition_text(p)}")
            if db.get(key) is not None:
                counts["cached"] += 1
                continue
            call = partitioned_call(node, calls[node.name], p)
            if call_bytes(call) > max_bytes:
                counts["skipped"] += 1
                continue
            try:
                fwd, bwd = measure_call(call, device=device, warmup=warmup, repeats=repeats, input_grads=input_grads,
                                        autocast=autocast)
            except (RuntimeError, ValueError, TypeError, IndexError):  # cannot run alone at this shape
                counts["skipped"] += 1
                continue
            db.put(key, ProfileEntry(forward_s=fwd, backward_s=bwd, repeats=repeats, target=node.target,
                                     node_bytes=node.bytes_written))
            counts["measured"] += 1
            if time.monotonic() - last_save > 2.0:
                db.save()
                last_save = time.monotonic()
    finally:  # an interrupted run keeps what it measured
        db.save()
    if progress is not None:
        progress(len(todo), len(todo), "done")
    return counts


def is_first_layer(graph: OpGraph, node: OpNode) -> bool:
    """A node with parameters whose inputs are all the model's inputs or constants: its
    backward computes no input gradient in the model (measured apart, :data:`LEAF`)."""
    if not node.param_bytes or not node.inputs:
        return False
    return all(graph.node(i).kind in SKIP_KINDS or not graph.node(i).inputs for i in node.inputs)


def profile_model(
    model: torch.nn.Module,
    example_inputs: tuple,
    *,
    out: str | Path | None = None,
    threads: int = 1,
    repeats: int = 5,
    warmup: int = 2,
    degrees: Iterable[int] = DEGREES,
    max_bytes: int = 2 << 30,
    progress: Callable[[int, int, str], None] | None = None,
    precision: str = "fp32",
) -> tuple[ProfileDB, dict[str, int]]:
    """Trace ``model`` in ``precision`` (:mod:`flexsearch.precision`) and profile its
    ops into ``out`` (default ``profiles/<device>.json``): mixed precision's under
    ``torch.autocast``, a cast precision's on the cast model."""
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    previous = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(threads)
    prec = precision_of(precision)
    tf32_before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    if device.type == "cuda" and prec.tf32:  # TF32 on for a TF32 profile; else the user's settings
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    try:
        name = local_device(threads if device.type == "cpu" else None)
        path = Path(out) if out is not None else default_profile_path(name)
        db = ProfileDB.load(path, device=name)
        if db.data.version < PROFILE_VERSION:  # measured another way: start afresh, do not mix the two
            db.data = ProfileFile(device=name)
        if not db.data.entries:
            db.data.host = host_info()
        graph, calls = trace_calls(model, example_inputs, precision=prec)
        counts = profile_graph(
            graph, calls, db, device=device, device_name=name, degrees=degrees,
            warmup=warmup, repeats=repeats, max_bytes=max_bytes, progress=progress, autocast=prec.autocast,
            tf32=prec.tf32,
        )  # fmt: skip
    finally:
        torch.set_num_threads(previous)
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32_before
    return db, counts


def default_profile_path(device: str) -> Path:
    """``profiles/<device>.json`` under the current directory."""
    return Path("profiles") / f"{device}.json"


def host_info() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__}


