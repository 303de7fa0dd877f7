"""Hardware specs as data, and the :class:`Cluster` value the cost models read.

A cluster preset is one JSON file in ``costmodels/clusters/``; every number in it is a
value with its source, ``{"value": 989e12, "source": "NVIDIA H100 datasheet"}``: a bare
number is a validation error. The file is validated by the pydantic models below
(frozen, ``extra="forbid"``), and every problem is reported as a one-line
:class:`~flexsearch.errors.ClusterSpecError` naming the file and the field.

Conventions (all numbers in SI units):

- bandwidths are bytes/s **per direction** (a "900 GB/s bidirectional" NVLink port is
  450e9 here); latencies are seconds; capacities are bytes; peaks are FLOP/s (dense,
  no sparsity).
- ``intra_node.bandwidth``: with ``topology="switch"`` (NVSwitch, a PCIe switch) every
  device has its own full-duplex port of that bandwidth; with ``topology="bus"`` the
  whole node shares one resource of that bandwidth (both directions together).
- ``inter_node.bandwidth``: one NIC, per direction; ``nics_per_node`` NICs per node,
  device ``d`` uses NIC ``local_index(d) % nics_per_node`` (round-robin).

Links are shared resources with stable ids (see :meth:`Cluster.links`)::

    intra.d{d}.tx / intra.d{d}.rx        switch port of device d (egress / ingress)
    intra.n{k}.bus                       shared bus of node k
    inter.n{k}.nic{j}.tx / .rx           NIC j of node k (egress / ingress)

A path's latency is charged on its sending link (``.tx`` or the bus); receiving links
carry latency 0, so an intra-node transfer costs ``intra_node.latency`` and an
inter-node transfer ``inter_node.latency``. Cross-node transfers go GPU -> NIC directly
(GPUDirect RDMA); the PCIe hop to the NIC is not modelled as a separate link.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    model_validator,
)

from flexsearch.errors import ClusterSpecError

COSTMODELS_DIR = Path(__file__).resolve().parents[1] / "costmodels"
"""Where the built-in data lives (package data): ``clusters/*.json`` (presets),
``efficiency.json`` and ``calibration.json``."""

PRESETS_DIR = COSTMODELS_DIR / "clusters"
"""The built-in presets."""


def user_dir() -> Path:
    """Where files this machine writes live, outside the package: ``$FLEXSEARCH_HOME``,
    else ``~/.flexsearch``: ``clusters/`` (presets measured here, e.g. by ``flexsearch
    profile --comm``; they shadow the built-in ones of the same name),
    ``calibration.json`` (``flexsearch calibrate``), ``measurements/``."""
    home = os.environ.get("FLEXSEARCH_HOME")
    return Path(home).expanduser() if home else Path.home() / ".flexsearch"


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


Source = Annotated[str, StringConstraints(strip_whitespace=True, min_length=1)]


class Positive(Frozen):
    """A number > 0 with its source (a datasheet, a paper, a measurement command)."""

    value: Annotated[float, Field(gt=0, allow_inf_nan=False)]
    source: Source


class NonNegative(Frozen):
    """A number >= 0 with its source."""

    value: Annotated[float, Field(ge=0, allow_inf_nan=False)]
    source: Source


class Count(Frozen):
    """An integer >= 1 with its source."""

    value: Annotated[int, Field(ge=1)]
    source: Source


class Fraction(Frozen):
    """A factor in (0, 1] with its source or the reasoning behind it."""

    value: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)]
    source: Source


class PeakFlops(Frozen):
    """Dense peak FLOP/s per dtype. ``tf32`` only where the hardware has it."""

    float32: Positive
    bfloat16: Positive
    float16: Positive
    tf32: Positive | None = None
    float64: Positive | None = None


class DeviceSpec(Frozen):
    """One accelerator (or one CPU process): peak compute, memory bandwidth, capacity."""

    name: Annotated[str, StringConstraints(strip_whitespace=True, min_length=1)]
    peak_flops: PeakFlops
    memory_bandwidth: Positive
    memory_capacity: Positive

    def peak(self, dtype: str) -> float:
        """Peak FLOP/s for a dtype named as in ``TensorMeta`` (``float32``...) or ``tf32``.

        A dtype the spec does not list (integers, bool, a missing ``tf32``/``float64``)
        falls back to the float32 peak."""
        entry = getattr(self.peak_flops, dtype, None) if dtype in PeakFlops.model_fields else None
        return (entry or self.peak_flops.float32).value


class IntraNodeLink(Frozen):
    """The links inside one node (see the module docstring for ``topology``)."""

    kind: Literal["nvlink", "pcie", "shared-memory"]
    topology: Literal["switch", "bus"]
    bandwidth: Positive
    latency: NonNegative


class InterNodeLink(Frozen):
    """The network between nodes: per-NIC bandwidth and latency, NICs per node."""

    kind: Literal["infiniband", "ethernet"]
    bandwidth: Positive
    latency: NonNegative
    nics_per_node: Count


class ClusterSpec(Frozen):
    """A cluster preset as stored: nodes of ``devices_per_node`` identical devices.

    ``max_nodes`` absent means unlimited; ``inter_node`` may be absent only when
    ``max_nodes`` is 1."""

    name: Annotated[str, StringConstraints(strip_whitespace=True, min_length=1)]
    description: str = ""
    device: DeviceSpec
    devices_per_node: Count
    max_nodes: Count | None = None
    intra_node: IntraNodeLink
    inter_node: InterNodeLink | None = None

    @model_validator(mode="after")
    def _inter_node_needed(self) -> ClusterSpec:
        if self.inter_node is None and (self.max_nodes is None or self.max_nodes.value > 1):
            raise ValueError("inter_node is required unless max_nodes is 1")
        return self

    @property
    def max_devices(self) -> int | None:
        """The most devices the preset can give, or None when unlimited."""
        if self.max_nodes is None:
            return None
        return self.max_nodes.value * self.devices_per_node.value


@dataclass(frozen=True)
class Link:
    """One shared communication resource: transfers on the same link id queue.

    ``latency`` is charged once per transfer that crosses the link."""

    id: str
    bandwidth: float
    latency: float
    kind: str


# --------------------------------------------------------------------------- files


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _loc(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def validation_message(where: str, err: ValidationError) -> str:
    """Translate pydantic's first error into one line naming the field and the fix."""
    errors = err.errors()
    e = errors[0]
    field = _loc(e["loc"])
    kind = e["type"]
    got = e.get("input")
    if kind == "missing":
        msg = f"field '{field}' is missing; add it"
        if field.split(".")[-1] not in ("kind", "topology", "name", "device"):
            msg += ' as {"value": ..., "source": "..."}'
    elif kind == "extra_forbidden":
        msg = f"unknown field '{field}'; remove it or fix its spelling"
    elif kind in ("model_type", "model_attributes_type") and isinstance(got, (int, float)):
        msg = f'field \'{field}\' has no source; write {{"value": {got!r}, "source": "..."}}'
    elif kind == "greater_than":
        msg = f"field '{field}' must be > {e['ctx']['gt']:g} (got {got!r}); use a positive number"
    elif kind == "greater_than_equal":
        msg = f"field '{field}' must be >= {e['ctx']['ge']:g} (got {got!r}); fix the value"
    elif kind == "less_than_equal":
        msg = f"field '{field}' must be <= {e['ctx']['le']:g} (got {got!r}); fix the value"
    elif kind == "value_error":
        msg = f"{e['msg'].removeprefix('Value error, ')}; fix the file"
    else:
        msg = f"field '{field}': {e['msg']} (got {got!r}); fix the value"
    more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    return _one_line(f"{where}: {msg}{more}")


def _read_text(path: Path, what: str) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        raise ClusterSpecError(f"{what} {path} not found; check the path") from None
    except OSError as e:
        raise ClusterSpecError(_one_line(f"{what} {path} cannot be read ({e.strerror}); check the path")) from None


def _parse_json(text: str, path: Path, what: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ClusterSpecError(
            f"{what} {path} is not valid JSON (line {e.lineno} column {e.colno}: {e.msg}); fix the syntax"
        ) from None


def read_json(path: Path, what: str) -> Any:
    return _parse_json(_read_text(path, what), path, what)


def _resolve_device(raw: Any, path: Path) -> Any:
    """``"device"`` may be inline or a device file name, resolved next to the cluster
    file (``x.json``, ``devices/x.json``) or in ``costmodels/devices/``."""
    if not isinstance(raw, dict) or not isinstance(raw.get("device"), str):
        return raw
    ref = raw["device"]
    name = ref if ref.endswith(".json") else f"{ref}.json"
    candidates = [path.parent / name, path.parent / "devices" / name, COSTMODELS_DIR / "devices" / name]
    for c in candidates:
        if c.is_file():
            device = read_json(c, "device file")
            try:
                DeviceSpec.model_validate(device)
            except ValidationError as e:
                raise ClusterSpecError(validation_message(f"device file {c}", e)) from None
            return {**raw, "device": device}
    raise ClusterSpecError(
        f"cluster file {path}: field 'device' names {ref!r} but no device file {name} was found "
        f"next to it or in {COSTMODELS_DIR / 'devices'}; inline the device or fix the name"
    )


def load_cluster_spec(path: str | os.PathLike[str]) -> ClusterSpec:
    """Read and validate one cluster file (read afresh every time: a profiler may
    rewrite it)."""
    p = Path(path).resolve()
    raw = _resolve_device(read_json(p, "cluster file"), p)
    try:
        return ClusterSpec.model_validate(raw)
    except ValidationError as e:
        raise ClusterSpecError(validation_message(f"cluster file {p}", e)) from None


def save_cluster_spec(spec: ClusterSpec, path: str | os.PathLike[str]) -> None:
    """Write a spec back as JSON (device inlined, absent optionals left out), so a
    profiler can replace numbers: ``spec.model_copy(update={...})`` then save."""
    data = spec.model_dump(mode="json", exclude_none=True)
    Path(path).write_text(json.dumps(data, indent=2) + "\n")


def available_presets() -> tuple[str, ...]:
    """Names of the presets: the built-in ones (``costmodels/clusters/``) and this
    machine's (:func:`user_dir` ``/clusters``)."""
    dirs = (PRESETS_DIR, user_dir() / "clusters")
    return tuple(sorted({p.stem for d in dirs for p in d.glob("*.json")}))


def preset_path(name: str) -> Path:
    """The file of a preset: this machine's (:func:`user_dir`) if it has one of that
    name, else the built-in one; unknown names raise ClusterSpecError listing them."""
    names = available_presets()
    if name not in names:
        raise ClusterSpecError(
            f"unknown cluster preset {name!r}; use one of: {', '.join(names)} (or a path to a cluster JSON file)"
        )
    mine = user_dir() / "clusters" / f"{name}.json"
    return mine if mine.is_file() else PRESETS_DIR / f"{name}.json"


# --------------------------------------------------------------------------- cluster


@dataclass(frozen=True)
class Cluster:
    """``devices`` devices of a :class:`ClusterSpec`, filling nodes in order
    (device ``d`` is on node ``d // devices_per_node``; the last node may be partial).

    An immutable, hashable value: equal specs and device counts compare equal."""

    spec: ClusterSpec
    devices: int

    def __post_init__(self) -> None:
        if isinstance(self.devices, bool) or not isinstance(self.devices, int) or self.devices < 1:
            raise ClusterSpecError(
                f"cluster {self.spec.name!r}: devices must be a positive integer (got {self.devices!r}); ask for 1 or more"
            )
        cap = self.spec.max_devices
        if cap is not None and self.devices > cap:
            raise ClusterSpecError(
                f"cluster {self.spec.name!r} has at most {cap} devices "
                f"({self.spec.max_nodes.value} nodes x {self.spec.devices_per_node.value}), "  # type: ignore[union-attr]
                f"{self.devices} requested; ask for {cap} or fewer or use another cluster"
            )

    def __getstate__(self) -> dict:
        """Pickled (to worker processes) without its memos, which each process rebuilds."""
        return {"spec": self.spec, "devices": self.devices}

    # -- construction
    @classmethod
    def from_spec(cls, spec: ClusterSpec, devices: int | None = None) -> Cluster:
        """``devices=None``: the whole preset when ``max_nodes`` is set, else one node."""
        if devices is None:
            devices = spec.max_devices or spec.devices_per_node.value
        return cls(spec=spec, devices=devices)

    @classmethod
    def preset(cls, name: str, devices: int | None = None) -> Cluster:
        """A built-in preset with ``devices`` devices (``ceil(devices / per_node)`` nodes)."""
        return cls.from_spec(load_cluster_spec(preset_path(name)), devices)

    @classmethod
    def load(cls, path: str | os.PathLike[str], devices: int | None = None) -> Cluster:
        """A cluster from a JSON file of the preset format."""
        return cls.from_spec(load_cluster_spec(path), devices)

    @classmethod
    def resolve(cls, name_or_path: str | os.PathLike[str], devices: int | None = None) -> Cluster:
        """``--cluster NAME|FILE``: a path if it ends in ``.json`` or exists, else a preset."""
        s = str(name_or_path)
        if s.endswith(".json") or os.sep in s or Path(s).is_file():
            return cls.load(s, devices)
        return cls.preset(s, devices)

    @staticmethod
    def available_presets() -> tuple[str, ...]:
        return available_presets()

    # -- layout
    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def device(self) -> DeviceSpec:
        return self.spec.device

    @property
    def devices_per_node(self) -> int:
        return self.spec.devices_per_node.value

    @property
    def num_nodes(self) -> int:
        return math.ceil(self.devices / self.devices_per_node)

    def _check(self, d: int) -> int:
        if not 0 <= d < self.devices:
            raise ValueError(f"device {d} is not in cluster {self.name!r} of {self.devices} devices")
        return d

    def node_of(self, d: int) -> int:
        return self._check(d) // self.devices_per_node

    def local_index(self, d: int) -> int:
        """Position of device ``d`` inside its node."""
        return self._check(d) % self.devices_per_node

    def node_devices(self, node: int) -> tuple[int, ...]:
        if not 0 <= node < self.num_nodes:
            raise ValueError(f"node {node} is not in cluster {self.name!r} of {self.num_nodes} nodes")
        start = node * self.devices_per_node
        return tuple(range(start, min(start + self.devices_per_node, self.devices)))

    def nic_of(self, d: int) -> int:
        """The NIC (index within its node) device ``d`` sends and receives through."""
        inter = self.spec.inter_node
        return self.local_index(d) % inter.nics_per_node.value if inter else 0

    # -- links
    @cached_property
    def _link_map(self) -> dict[str, Link]:
        intra = self.spec.intra_node
        bw, lat, kind = intra.bandwidth.value, intra.latency.value, intra.kind
        out: list[Link] = []
        if intra.topology == "switch":
            for d in range(self.devices):
                out.append(Link(f"intra.d{d}.tx", bw, lat, kind))
                out.append(Link(f"intra.d{d}.rx", bw, 0.0, kind))
        else:
            for k in range(self.num_nodes):
                out.append(Link(f"intra.n{k}.bus", bw, lat, kind))
        inter = self.spec.inter_node
        if inter is not None and self.num_nodes > 1:
            ibw, ilat = inter.bandwidth.value, inter.latency.value
            for k in range(self.num_nodes):
                used = min(inter.nics_per_node.value, len(self.node_devices(k)))
                for j in range(used):
                    out.append(Link(f"inter.n{k}.nic{j}.tx", ibw, ilat, inter.kind))
                    out.append(Link(f"inter.n{k}.nic{j}.rx", ibw, 0.0, inter.kind))
        return {link.id: link for link in out}

    @property
    def links(self) -> tuple[Link, ...]:
        """Every link of the cluster, in a fixed order."""
        return tuple(self._link_map.values())

    def link(self, link_id: str) -> Link:
        return self._link_map[link_id]

    def path(self, src: int, dst: int) -> tuple[Link, ...]:
        """The links a transfer from ``src`` to ``dst`` crosses, in order.

        Same device: ``()``. Same node: ``(intra.d{src}.tx, intra.d{dst}.rx)`` on a
        switch, ``(intra.n{k}.bus,)`` on a bus. Different nodes: the sending node's NIC
        egress and the receiving node's NIC ingress (NICs assigned round-robin)."""
        memo = self._paths
        hit = memo.get((src, dst))
        if hit is None:
            hit = memo[src, dst] = self._path(src, dst)
        return hit

    @cached_property
    def _paths(self) -> dict[tuple[int, int], tuple[Link, ...]]:
        """:meth:`path`'s memo: a collective over thousands of devices asks for the same
        paths again and again."""
        return {}

    def _path(self, src: int, dst: int) -> tuple[Link, ...]:
        ns, nd = self.node_of(src), self.node_of(dst)
        if src == dst:
            return ()
        m = self._link_map
        if ns == nd:
            if self.spec.intra_node.topology == "switch":
                return (m[f"intra.d{src}.tx"], m[f"intra.d{dst}.rx"])
            return (m[f"intra.n{ns}.bus"],)
        return (m[f"inter.n{ns}.nic{self.nic_of(src)}.tx"], m[f"inter.n{nd}.nic{self.nic_of(dst)}.rx"])

    def group_by_node(self, group: Iterable[int]) -> tuple[tuple[int, ...], ...]:
        """The devices of ``group`` split by node, nodes and devices in ascending order."""
        by: dict[int, list[int]] = {}
        for d in sorted(group):
            by.setdefault(self.node_of(d), []).append(d)
        return tuple(tuple(by[k]) for k in sorted(by))
