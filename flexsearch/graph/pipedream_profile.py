"""Reader and writer for PipeDream's layer-profile format (``graph.txt``).

PipeDream (Narayanan et al., SOSP 2019) profiles a model once and hands its optimizer a
text file with one line per layer and one line per edge::

    node1 -- Input0 -- forward_compute_time=0.000, backward_compute_time=0.000,
        activation_size=602112.0, parameter_size=0.000
    node2 -- Conv2d(3, 64, kernel_size=(3, 3), stride=(1, 1), padding=(1, 1)) -- ...
    <TAB>node1 -- node2

(each node on one line in the file). A node line is ``ID -- DESCRIPTION --
forward_compute_time=F, backward_compute_time=B, activation_size=A, parameter_size=P``:
F and B are milliseconds per minibatch, A (the bytes of the layer's output) and P (the
bytes of its parameters) are bytes. An edge line, indented by a tab, is ``ID1 -- ID2``:
the output of ID1 feeds ID2.

What the reader accepts beyond that, as PipeDream's own files do or might:

* any amount of whitespace around ``--``, ``,`` and ``=``; blank lines; CRLF line ends;
* an empty description, or the description after the metrics (``ID -- METRICS -- DESC``);
* a trailing ``-- stage_id=N`` (written by PipeDream's partitioner; kept in
  :attr:`ProfileNode.stage_id` and written back);
* ``activation_size=[A1; A2]`` for a layer with several outputs (summed, as PipeDream does);
* an edge line without the tab when both of its ids are node ids; edges before the nodes
  they name; the same edge twice (kept once).

Every problem in a file is a :class:`~flexsearch.errors.ModelLoadError` with a one-line
message naming the file, the line, what is wrong and the fix.
"""

from __future__ import annotations

import heapq
import math
import re
from functools import cached_property
from pathlib import Path
from typing import Annotated

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from flexsearch.errors import ModelLoadError

__all__ = [
    "ProfileGraph",
    "ProfileNode",
    "format_profile",
    "is_profile_file",
    "load_profile",
    "parse_profile",
]

_FORMAT_HINT = (
    "expected 'ID -- DESCRIPTION -- forward_compute_time=F, backward_compute_time=B, "
    "activation_size=A, parameter_size=P' or a tab-indented edge 'ID1 -- ID2'; "
    "see PipeDream's profile format"
)

# The four metric keys, in the order PipeDream writes them, and the ProfileNode field each fills.
_KEYS: dict[str, str] = {
    "forward_compute_time": "forward_ms",
    "backward_compute_time": "backward_ms",
    "activation_size": "activation_bytes",
    "parameter_size": "parameter_bytes",
}

# `` -- `` with any whitespace around it; the dashes must be a token of their own.
_SEPARATOR = re.compile(r"\s+--(?=\s|$)")
# The same, but also at the start of a string: what a description may not contain.
_SEPARATOR_ANYWHERE = re.compile(r"(?:^|\s)--(?:\s|$)")
_METRICS_START = re.compile(r"^(?:" + "|".join(_KEYS) + r")\s*=")
_STAGE = re.compile(r"^stage_id\s*=\s*(.*)$")
# Cheap sniff of a node line, for is_profile_file.
_NODE_SNIFF = re.compile(r"^\S+\s+--\s.*\bforward_compute_time\s*=")

_SNIFF_LIMIT = 1 << 16

NonNegative = Annotated[float, Field(ge=0, allow_inf_nan=False)]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ProfileNode(_Frozen):
    """One layer of a PipeDream profile.

    ``forward_ms``/``backward_ms``: compute time of one minibatch in milliseconds;
    ``activation_bytes``: bytes of the layer's output for one minibatch;
    ``parameter_bytes``: bytes of its parameters. All four are finite and non-negative.
    ``stage_id`` is the pipeline stage PipeDream's partitioner assigned, if the file has one.
    """

    id: str
    description: str
    forward_ms: NonNegative
    backward_ms: NonNegative
    activation_bytes: NonNegative
    parameter_bytes: NonNegative
    stage_id: Annotated[int, Field(ge=0)] | None = None

    @field_validator("id")
    @classmethod
    def _check_id(cls, value: str) -> str:
        if not value or any(c.isspace() for c in value):
            raise ValueError(f"node id {value!r} must be non-empty and hold no whitespace")
        return value

    @field_validator("description")
    @classmethod
    def _check_description(cls, value: str) -> str:
        if "\n" in value or "\r" in value:
            raise ValueError("a description must be one line")
        if value != value.strip():
            raise ValueError(f"description {value!r} must not start or end with whitespace")
        if _SEPARATOR_ANYWHERE.search(value):
            raise ValueError(f"description {value!r} must not contain the separator ' -- '")
        return value


class ProfileGraph(_Frozen):
    """A PipeDream profile: layers in file order and directed edges ``(producer, consumer)``.

    Valid by construction: at least one node, unique node ids, every edge between two
    nodes of the graph, no edge twice, no cycle.
    """

    nodes: tuple[ProfileNode, ...]
    edges: tuple[tuple[str, str], ...] = ()

    @model_validator(mode="after")
    def _check(self) -> ProfileGraph:
        if not self.nodes:
            raise ValueError("a profile graph needs at least one node")
        seen: set[str] = set()
        for node in self.nodes:
            if node.id in seen:
                raise ValueError(f"duplicate node id {node.id!r}")
            seen.add(node.id)
        seen_edges: set[tuple[str, str]] = set()
        for src, dst in self.edges:
            for end in (src, dst):
                if end not in seen:
                    raise ValueError(f"edge {src} -> {dst} names unknown node {end!r}")
            if (src, dst) in seen_edges:
                raise ValueError(f"edge {src} -> {dst} appears twice")
            seen_edges.add((src, dst))
        cycle = _find_cycle([n.id for n in self.nodes], self.edges)
        if cycle is not None:
            raise ValueError("the graph has a cycle: " + " -> ".join(cycle))
        return self

    @cached_property
    def _index(self) -> dict[str, int]:
        return {node.id: i for i, node in enumerate(self.nodes)}

    @cached_property
    def _consumers(self) -> dict[str, tuple[str, ...]]:
        out: dict[str, list[str]] = {node.id: [] for node in self.nodes}
        for src, dst in self.edges:
            out[src].append(dst)
        return {k: tuple(v) for k, v in out.items()}

    @cached_property
    def _producers(self) -> dict[str, tuple[str, ...]]:
        out: dict[str, list[str]] = {node.id: [] for node in self.nodes}
        for src, dst in self.edges:
            out[dst].append(src)
        return {k: tuple(v) for k, v in out.items()}

    def node(self, node_id: str) -> ProfileNode:
        """The node with id ``node_id`` (``KeyError`` if there is none)."""
        return self.nodes[self._lookup(node_id)]

    def consumers(self, node_id: str) -> tuple[str, ...]:
        """Ids of the nodes that read ``node_id``'s output, in edge order."""
        self._lookup(node_id)
        return self._consumers[node_id]

    def producers(self, node_id: str) -> tuple[str, ...]:
        """Ids of the nodes whose output ``node_id`` reads, in edge order."""
        self._lookup(node_id)
        return self._producers[node_id]

    def topological_order(self) -> tuple[str, ...]:
        """Node ids, producers before consumers; ties go to the node earlier in the file.

        Kahn's algorithm with a heap on file position, so a file already in
        topological order comes back unchanged.
        """
        return _kahn([n.id for n in self.nodes], self.edges)[0]

    def _lookup(self, node_id: str) -> int:
        try:
            return self._index[node_id]
        except KeyError:
            raise KeyError(f"no node {node_id!r} in the profile") from None


def _kahn(
    ids: list[str], edges: tuple[tuple[str, str], ...] | list[tuple[str, str]]
) -> tuple[tuple[str, ...], dict[str, int]]:
    """Kahn's algorithm preferring file order: the order and the in-degrees left over."""
    index = {node_id: i for i, node_id in enumerate(ids)}
    succ: dict[str, list[str]] = {node_id: [] for node_id in ids}
    indeg = dict.fromkeys(ids, 0)
    for src, dst in edges:
        succ[src].append(dst)
        indeg[dst] += 1
    ready = [index[node_id] for node_id in ids if indeg[node_id] == 0]
    heapq.heapify(ready)
    order: list[str] = []
    while ready:
        node_id = ids[heapq.heappop(ready)]
        order.append(node_id)
        for dst in succ[node_id]:
            indeg[dst] -= 1
            if indeg[dst] == 0:
                heapq.heappush(ready, index[dst])
    return tuple(order), indeg


def _find_cycle(
    ids: list[str], edges: tuple[tuple[str, str], ...] | list[tuple[str, str]]
) -> list[str] | None:
    """One cycle as ``[a, b, ..., a]``, or None when the graph is acyclic."""
    order, indeg = _kahn(ids, edges)
    if len(order) == len(ids):
        return None
    # A node left with in-degree > 0 has a predecessor that is also left over, so walking
    # from one to a left-over predecessor must come back to a node already seen.
    stuck = {node_id for node_id, d in indeg.items() if d > 0}
    pred: dict[str, str] = {}
    for src, dst in edges:
        if src in stuck and dst in stuck and dst not in pred:
            pred[dst] = src
    start = next(node_id for node_id in ids if node_id in stuck)
    path: list[str] = []
    pos: dict[str, int] = {}
    node_id = start
    while node_id not in pos:
        pos[node_id] = len(path)
        path.append(node_id)
        node_id = pred[node_id]
    cycle = path[pos[node_id] :]
    cycle.reverse()  # walked against the edges
    position = {node_id: i for i, node_id in enumerate(ids)}
    first = min(range(len(cycle)), key=lambda i: position[cycle[i]])  # start at the earliest node
    cycle = cycle[first:] + cycle[:first]
    return [*cycle, cycle[0]]


# ---------------------------------------------------------------------------------------------
# Reading


def _short(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _parse_number(key: str, raw: str, where: str) -> float:
    raw = raw.strip()
    if raw.startswith("[") and key == "activation_size":
        if not raw.endswith("]"):
            raise ModelLoadError(
                f"{where}: {key}={_short(raw)!s} has no closing ']'; write [A1; A2]"
            )
        parts = [p for p in re.split(r"[;,]", raw[1:-1])]
        values = [_parse_number(key, p, where) for p in parts if p.strip()]
        if not values:
            raise ModelLoadError(f"{where}: {key}=[] is empty; give the output sizes in bytes")
        return math.fsum(values)
    try:
        value = float(raw)
    except ValueError:
        raise ModelLoadError(
            f"{where}: {key}={_short(raw)!r} is not a number; write a plain decimal such as 1.25"
        ) from None
    if not math.isfinite(value):
        raise ModelLoadError(
            f"{where}: {key}={raw} is not finite; write a finite non-negative number"
        )
    if value < 0:
        raise ModelLoadError(f"{where}: {key}={raw} is negative; times and sizes must be >= 0")
    return value + 0.0  # -0.0 -> 0.0


def _split_metrics(text: str) -> list[str]:
    """Split ``k=v, k=[a, b], ...`` on the commas outside brackets."""
    parts: list[str] = []
    depth = 0
    current: list[str] = []
    for char in text:
        if char == "[":
            depth += 1
        elif char == "]":
            depth = max(0, depth - 1)
        if char == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    parts.append("".join(current))
    return parts


def _parse_metrics(text: str, where: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for part in _split_metrics(text):
        part = part.strip()
        if not part:
            continue
        key, eq, raw = part.partition("=")
        key = key.strip()
        if not eq:
            raise ModelLoadError(
                f"{where}: {_short(part)!r} is not KEY=VALUE; write the metrics as "
                "'forward_compute_time=F, backward_compute_time=B, activation_size=A, "
                "parameter_size=P'"
            )
        if key not in _KEYS:
            raise ModelLoadError(
                f"{where}: unknown key {_short(key)!r}; the keys are " + ", ".join(_KEYS)
            )
        if key in values:
            raise ModelLoadError(f"{where}: {key} is given twice; keep one")
        values[key] = _parse_number(key, raw, where)
    missing = [key for key in _KEYS if key not in values]
    if missing:
        raise ModelLoadError(
            f"{where}: missing {', '.join(missing)}; a node line needs all of " + ", ".join(_KEYS)
        )
    return values


def _parse_node(tokens: list[str], where: str) -> ProfileNode:
    node_id, rest = tokens[0], tokens[1:]
    stage_id: int | None = None
    if len(rest) == 3 and (stage := _STAGE.match(rest[-1])):
        raw = stage.group(1).strip()
        if not re.fullmatch(r"\d+", raw):
            raise ModelLoadError(
                f"{where}: stage_id={_short(raw)!r} is not a non-negative integer; write e.g. stage_id=0"
            )
        stage_id = int(raw)
        rest = rest[:-1]
    if len(rest) != 2:
        raise ModelLoadError(
            f"{where}: {len(rest) + 1} ' -- '-separated parts where a node line has 3 "
            "(a description may not contain ' -- '); " + _FORMAT_HINT
        )
    description, metrics = rest
    if _METRICS_START.match(description) and not _METRICS_START.match(metrics):
        description, metrics = metrics, description  # description written last
    if not _METRICS_START.match(metrics) and not re.match(r"^\w+\s*=", metrics):
        raise ModelLoadError(f"{where}: no forward_compute_time=... part; " + _FORMAT_HINT)
    values = _parse_metrics(metrics, where)
    fields = {_KEYS[key]: value for key, value in values.items()}
    try:
        return ProfileNode(id=node_id, description=description, stage_id=stage_id, **fields)
    except ValidationError as exc:
        reason = " ".join(str(exc.errors()[0]["msg"]).split())
        raise ModelLoadError(f"{where}: {reason}; " + _FORMAT_HINT) from None


def parse_profile(text: str, source: str = "<text>") -> ProfileGraph:
    """Parse the text of a PipeDream ``graph.txt``; ``source`` names it in error messages.

    Raises :class:`~flexsearch.errors.ModelLoadError` (one-line message with the line
    number) for a malformed line, a missing, unknown, repeated, non-numeric, non-finite
    or negative metric, a duplicate node id, an edge naming an unknown node, a cycle, or
    a text without nodes.
    """
    if text.startswith("\ufeff"):
        text = text[1:]
    nodes: list[ProfileNode] = []
    node_line: dict[str, int] = {}
    # (line number, producer, consumer, tab-indented)
    raw_edges: list[tuple[int, str, str, bool]] = []
    for number, line in enumerate(text.split("\n"), start=1):
        line = line.rstrip("\r")
        if not line.strip():
            continue
        where = f"{source} line {number}"
        tokens = [t.strip() for t in _SEPARATOR.split(line.strip())]
        if len(tokens) == 1:
            raise ModelLoadError(f"{where}: no ' -- ' in {_short(line.strip())!r}; " + _FORMAT_HINT)
        if not tokens[0] or any(c.isspace() for c in tokens[0]):
            raise ModelLoadError(
                f"{where}: {_short(line.strip())!r} does not start with a node id; " + _FORMAT_HINT
            )
        if len(tokens) == 2:
            dst = tokens[1]
            if not dst or any(c.isspace() for c in dst):
                raise ModelLoadError(
                    f"{where}: {_short(line.strip())!r} is neither a node nor an edge; "
                    + _FORMAT_HINT
                )
            raw_edges.append((number, tokens[0], dst, line[0].isspace()))
            continue
        node = _parse_node(tokens, where)
        if node.id in node_line:
            raise ModelLoadError(
                f"{where}: duplicate node id {node.id!r} (first on line {node_line[node.id]}); "
                "give every node its own id"
            )
        node_line[node.id] = number
        nodes.append(node)

    if not nodes:
        raise ModelLoadError(
            f"{source}: no node lines; a PipeDream profile needs at least one line "
            "'ID -- DESCRIPTION -- forward_compute_time=F, backward_compute_time=B, "
            "activation_size=A, parameter_size=P'"
        )

    edges: list[tuple[str, str]] = []
    edge_line: dict[tuple[str, str], int] = {}
    for number, src, dst, indented in raw_edges:
        where = f"{source} line {number}"
        for end in (src, dst):
            if end not in node_line:
                if indented:
                    raise ModelLoadError(
                        f"{where}: edge {src} -> {dst} names unknown node {end!r}; "
                        "add a node line for it or fix the id"
                    )
                raise ModelLoadError(
                    f"{where}: {src!r} -- {dst!r} is not a node line (no metrics) and not an edge "
                    f"({end!r} is no node id); " + _FORMAT_HINT
                )
        if (src, dst) in edge_line:
            continue  # PipeDream can write an edge twice (a layer reading one input twice)
        edge_line[(src, dst)] = number
        edges.append((src, dst))

    cycle = _find_cycle([n.id for n in nodes], edges)
    if cycle is not None:
        closing = max(edge_line[(cycle[i], cycle[i + 1])] for i in range(len(cycle) - 1))
        raise ModelLoadError(
            f"{source} line {closing}: edges form a cycle {' -> '.join(cycle)}; "
            "a profile must be a DAG, remove one of these edges"
        )
    return ProfileGraph(nodes=tuple(nodes), edges=tuple(edges))


def load_profile(path: str | Path) -> ProfileGraph:
    """Read and parse a PipeDream ``graph.txt``; see :func:`parse_profile`."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        reason = " ".join(str(reason).split())
        raise ModelLoadError(
            f"{path}: cannot read the profile ({reason}); check the path and that it is a UTF-8 text file"
        ) from None
    return parse_profile(text, source=str(path))


# ---------------------------------------------------------------------------------------------
# Writing and sniffing


def _number(value: float) -> str:
    return repr(float(value))


def format_profile(graph: ProfileGraph) -> str:
    """The graph as PipeDream's ``graph.txt`` text: node lines, then tab-indented edges.

    Numbers are written in Python's shortest round-trip form, so
    ``parse_profile(format_profile(g)) == g``.
    """
    lines = []
    for node in graph.nodes:
        line = (
            f"{node.id} -- {node.description} -- "
            f"forward_compute_time={_number(node.forward_ms)}, "
            f"backward_compute_time={_number(node.backward_ms)}, "
            f"activation_size={_number(node.activation_bytes)}, "
            f"parameter_size={_number(node.parameter_bytes)}"
        )
        if node.stage_id is not None:
            line += f" -- stage_id={node.stage_id}"
        lines.append(line)
    lines.extend(f"\t{src} -- {dst}" for src, dst in graph.edges)
    return "\n".join(lines) + "\n"


def is_profile_file(path: str | Path) -> bool:
    """Whether ``path`` looks like a PipeDream profile rather than a Python model file.

    True for an existing ``.txt`` file whose first non-blank line has the shape of a node
    line (``ID -- ... forward_compute_time=...``). Reads at most 64 KiB; never raises.
    """
    path = Path(path)
    if path.suffix.lower() != ".txt":
        return False
    try:
        with path.open("r", encoding="utf-8", errors="replace") as handle:
            head = handle.read(_SNIFF_LIMIT)
    except OSError:
        return False
    head = head.removeprefix("\ufeff")
    for line in head.split("\n"):
        if line.strip():
            return bool(_NODE_SNIFF.match(line.strip()))
    return False
