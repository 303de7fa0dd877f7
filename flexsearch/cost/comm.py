"""Alpha-beta communication cost over a :class:`~flexsearch.cost.hardware.Cluster`.

Pure functions of (cluster, devices, bytes). Every collective is built from one
primitive, the **phase**: a set of transfers that run at the same time. A phase costs

    latency_steps * max_t alpha(t)  +  bandwidth_steps * max_l bytes(l) / B(l)

where ``alpha(t)`` is the summed latency of transfer t's path, ``bytes(l)`` the bytes
all of the phase's transfers put on link ``l`` and ``B(l)`` its bandwidth. Transfers
that share a link (two ring edges leaving through one NIC, every edge on a shared bus)
therefore share its bandwidth. A step-synchronous algorithm of s identical steps is a
phase with ``latency_steps = bandwidth_steps = s``; a pipelined chain or tree pays the
latency once per hop but the bandwidth once (``bandwidth_steps = 1``).

On a uniform switch (every transfer crosses links of latency alpha and bandwidth B,
no sharing) the algorithms reduce to the textbook formulas in their docstrings (n ranks,
M bytes). Ranks are ordered by device id (node by node), as NCCL orders rings by
topology. A ring over several nodes runs ``C = min(nics_per_node, most group devices
on one node)`` channels, each leaving every node through a different device, so the
crossing edges spread over C NICs; each channel carries 1/C of the data.

Every collective returns a :class:`CommCost`: time, algorithm, and the bytes it puts
on each link (``loads``) for a simulator that queues transfers on link ids. Without
``algorithm=`` the fastest applicable algorithm is chosen (ties: the first listed);
a group of one device, or 0 bytes, costs 0 with algorithm ``"none"``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache

from flexsearch.cost.hardware import Cluster, Link

ALGORITHMS: dict[str, tuple[str, ...]] = {
    "all_reduce": ("ring", "tree", "hierarchical"),
    "all_gather": ("ring", "tree", "hierarchical"),
    "reduce_scatter": ("ring", "tree", "hierarchical"),
    "broadcast": ("ring", "tree", "hierarchical"),
    "all_to_all": ("direct", "hierarchical"),
}
"""The algorithms each collective offers, in tie-breaking order. All-to-all has no ring
or tree form here (NCCL runs it as grouped point-to-point sends)."""


@dataclass(frozen=True)
class CommCost:
    """The cost of one communication: ``time_s``, the ``algorithm`` that gives it, and
    ``loads``: (link, bytes) for every link it crosses, sorted by link id."""

    op: str
    algorithm: str
    time_s: float
    loads: tuple[tuple[Link, float], ...] = ()

    @property
    def links(self) -> tuple[Link, ...]:
        """The links this communication loads."""
        return tuple(link for link, _ in self.loads)


@dataclass(frozen=True)
class _Phase:
    latency_steps: int
    bandwidth_steps: int
    transfers: tuple[tuple[int, int, float], ...]  # (src, dst, fraction of M)


@dataclass(frozen=True)
class _Shape:
    """time(M) = alpha + beta * M; ``per_byte[l]``: bytes on link l per byte of M."""

    alpha: float
    beta: float
    per_byte: tuple[tuple[Link, float], ...]


# --------------------------------------------------------------------------- helpers


def _group(cluster: Cluster, group: Iterable[int]) -> tuple[int, ...]:
    g = tuple(group)
    if len(g) == 0:
        raise ValueError("a communication group needs at least one device")
    if len(set(g)) != len(g):
        raise ValueError(f"group {g} repeats a device")
    for d in g:
        if isinstance(d, bool) or not isinstance(d, int) or not 0 <= d < cluster.devices:
            raise ValueError(f"device {d!r} is not in cluster {cluster.name!r} of {cluster.devices} devices")
    return tuple(sorted(g))


def _check_bytes(nbytes: float) -> float:
    if not math.isfinite(nbytes) or nbytes < 0:
        raise ValueError(f"nbytes must be a finite number >= 0 (got {nbytes!r})")
    return float(nbytes)


def _phase_terms(cluster: Cluster, transfers: Iterable[tuple[int, int, float]]) -> tuple[float, float, dict[str, float]]:
    """(max path latency, max link load / bandwidth, load per link id) of concurrent
    transfers (keyed by id: a string hashes in C, a :class:`Link` in Python)."""
    lat = 0.0
    load: dict[str, float] = {}
    get = load.get
    path = cluster.path
    for src, dst, amount in transfers:
        if src == dst or amount <= 0:
            continue
        here = 0
        for link in path(src, dst):
            here += link.latency
            load[link.id] = get(link.id, 0.0) + amount
        if here > lat:
            lat = here
    bw_time = max((b / cluster.link(i).bandwidth for i, b in load.items()), default=0.0)
    return lat, bw_time, load


def _shape(cluster: Cluster, phases: Sequence[_Phase]) -> _Shape:
    alpha = beta = 0.0
    per_byte: dict[str, float] = {}
    for p in phases:
        lat, bw_time, load = _phase_terms(cluster, p.transfers)
        alpha += p.latency_steps * lat
        beta += p.bandwidth_steps * bw_time
        for i, b in load.items():
            per_byte[i] = per_byte.get(i, 0.0) + p.bandwidth_steps * b
    return _Shape(alpha, beta, tuple((cluster.link(i), f) for i, f in sorted(per_byte.items())))


def _cost(op: str, algorithm: str, shape: _Shape, nbytes: float) -> CommCost:
    if nbytes == 0 or (shape.alpha == 0 and shape.beta == 0):
        return CommCost(op, "none", 0.0)
    loads = tuple((link, f * nbytes) for link, f in shape.per_byte)
    return CommCost(op, algorithm, shape.alpha + shape.beta * nbytes, loads)


def _rings(cluster: Cluster, nodes: tuple[tuple[int, ...], ...]) -> list[list[int]]:
    """Ring channels over the group, node by node. Channel c enters every node at its
    c-th group device and leaves from the one before it, so the C channels cross node
    boundaries through C different devices (and NICs)."""
    if len(nodes) == 1:
        return [list(nodes[0])]
    nics = cluster.spec.inter_node.nics_per_node.value  # type: ignore[union-attr]
    channels = min(nics, max(len(ds) for ds in nodes))
    rings = []
    for c in range(channels):
        ring: list[int] = []
        for ds in nodes:
            r = c % len(ds)
            ring.extend(ds[r:] + ds[:r])
        rings.append(ring)
    return rings


def _ring_step(rings: list[list[int]], fraction: float) -> tuple[tuple[int, int, float], ...]:
    """One ring step: every rank sends ``fraction / channels`` of M to its successor."""
    share = fraction / len(rings)
    return tuple((r[i], r[(i + 1) % len(r)], share) for r in rings for i in range(len(r)))


def _chains(rings: list[list[int]], root: int) -> tuple[tuple[int, int, float], ...]:
    """Each ring cut open at ``root``: a pipelined chain carrying 1/channels of M."""
    out = []
    for r in rings:
        i = r.index(root)
        order = r[i:] + r[:i]
        out.extend((order[j], order[j + 1], 1.0 / len(rings)) for j in range(len(order) - 1))
    return tuple(out)


def _depth(n: int) -> int:
    """Depth of a heap-ordered binary tree of n ranks: floor(log2 n)."""
    return n.bit_length() - 1


def _tree_edges(order: Sequence[int], fraction: float) -> list[tuple[int, int, float]]:
    """(child, parent, fraction) for the heap-ordered binary tree over ``order``."""
    return [(order[i], order[(i - 1) // 2], fraction) for i in range(1, len(order))]


def _equal_nodes(nodes: tuple[tuple[int, ...], ...]) -> bool:
    return len({len(ds) for ds in nodes}) == 1


def _flip(transfers: Iterable[tuple[int, int, float]]) -> tuple[tuple[int, int, float], ...]:
    return tuple((d, s, f) for s, d, f in transfers)


# --------------------------------------------------------------------------- algorithms


def _phases(cluster: Cluster, op: str, algorithm: str, g: tuple[int, ...], root: int) -> list[_Phase]:
    n = len(g)
    nodes = cluster.group_by_node(g)
    k = len(nodes)
    if algorithm == "ring":
        rings = _rings(cluster, nodes)
        if op == "all_reduce":
            return [_Phase(2 * (n - 1), 2 * (n - 1), _ring_step(rings, 1 / n))]
        if op in ("all_gather", "reduce_scatter"):
            return [_Phase(n - 1, n - 1, _ring_step(rings, 1 / n))]
        return [_Phase(n - 1, 1, _chains(rings, root))]  # broadcast
    if algorithm == "tree":
        if op == "all_reduce":
            up = _tree_edges(g, 0.5) + _tree_edges(g[::-1], 0.5)  # double binary tree
            return [_Phase(_depth(n), 1, tuple(up)), _Phase(_depth(n), 1, _flip(up))]
        if op in ("all_gather", "reduce_scatter"):
            phases = []
            dist = 1
            while dist < n:  # Bruck / recursive doubling: ceil(log2 n) rounds
                block = min(dist, n - dist) / n
                phases.append(_Phase(1, 1, tuple((g[i], g[(i + dist) % n], block) for i in range(n))))
                dist *= 2
            return phases
        order = (root,) + tuple(d for d in g if d != root)  # broadcast
        return [_Phase(_depth(n), 1, _flip(_tree_edges(order, 1.0)))]
    if algorithm == "hierarchical":
        if op == "broadcast":
            pos = cluster.local_index(root)
            leaders = []
            for ds in nodes:
                if root in ds:
                    leaders.append(root)
                else:
                    same = [d for d in ds if cluster.local_index(d) == pos]
                    leaders.append(same[0] if same else ds[0])
            leaders.sort(key=lambda d: d != root)
            across = tuple((leaders[i], leaders[i + 1], 1.0) for i in range(len(leaders) - 1))
            inside = []
            for ds in nodes:
                lead = next(d for d in ds if d in leaders)
                chain = [lead] + [d for d in ds if d != lead]
                inside.extend((chain[i], chain[i + 1], 1.0) for i in range(len(chain) - 1))
            longest = max(len(ds) for ds in nodes)
            return [_Phase(k - 1, 1, across), _Phase(longest - 1, 1, tuple(inside))]
        if not _equal_nodes(nodes):
            raise ValueError(
                f"hierarchical {op} needs the same number of group devices on every node "
                f"(got {[len(ds) for ds in nodes]}); use ring or tree"
            )
        m = len(nodes[0])
        intra = [list(ds) for ds in nodes]
        inter = [[ds[j] for ds in nodes] for j in range(m)]
        if op == "all_to_all":
            local = tuple((a, b, 1 / m) for ds in nodes for a in ds for b in ds if a != b)
            remote = tuple((a, b, 1 / k) for col in inter for a in col for b in col if a != b)
            return [_Phase(m - 1, 1, local), _Phase(k - 1, 1, remote)]
        rs_in = _Phase(m - 1, m - 1, _ring_step_each(intra, 1 / m))
        if op == "all_reduce":
            across = _Phase(2 * (k - 1), 2 * (k - 1), _ring_step_each(inter, 1 / (m * k)))
            return [rs_in, across, rs_in]
        across = _Phase(k - 1, k - 1, _ring_step_each(inter, 1 / n))
        return [across, rs_in] if op == "all_gather" else [rs_in, across]
    if algorithm == "direct":  # all_to_all
        return [_Phase(n - 1, 1, tuple((a, b, 1 / n) for a in g for b in g if a != b))]
    raise AssertionError(algorithm)


def _ring_step_each(rings: list[list[int]], fraction: float) -> tuple[tuple[int, int, float], ...]:
    """One step of several independent rings at once, each sending ``fraction`` of M."""
    return tuple((r[i], r[(i + 1) % len(r)], fraction) for r in rings if len(r) > 1 for i in range(len(r)))


@lru_cache(maxsize=16384)
def _cached_shape(cluster: Cluster, op: str, algorithm: str, g: tuple[int, ...], root: int) -> _Shape:
    return _shape(cluster, _phases(cluster, op, algorithm, g, root))


def collective(
    op: str,
    cluster: Cluster,
    group: Iterable[int],
    nbytes: float,
    *,
    algorithm: str | None = None,
    root: int | None = None,
) -> CommCost:
    """Cost of collective ``op`` (a key of :data:`ALGORITHMS`) on ``group``.

    ``algorithm=None`` picks the fastest applicable one; a forced algorithm that the op
    does not offer or that does not apply (hierarchical on unequal nodes) raises
    ValueError."""
    if op not in ALGORITHMS:
        raise ValueError(f"unknown collective {op!r}; use one of {', '.join(ALGORITHMS)}")
    g = _group(cluster, group)
    m = _check_bytes(nbytes)
    if root is None:
        root = g[0]
    elif root not in g:
        raise ValueError(f"root {root} is not in the group {g}")
    if algorithm is not None and algorithm not in ALGORITHMS[op]:
        raise ValueError(f"{op} has no algorithm {algorithm!r}; use one of {', '.join(ALGORITHMS[op])}")
    if len(g) == 1:
        return CommCost(op, "none", 0.0)
    if algorithm is not None:  # raises ValueError when it does not apply to this group
        return _cost(op, algorithm, _cached_shape(cluster, op, algorithm, g, root), m)
    if m == 0:
        return CommCost(op, "none", 0.0)
    best: CommCost | None = None
    for name in ALGORITHMS[op]:
        try:
            shape = _cached_shape(cluster, op, name, g, root)
        except ValueError:
            continue
        cost = _cost(op, name, shape, m)
        if best is None or cost.time_s < best.time_s:
            best = cost
    assert best is not None
    return best


def all_reduce(cluster: Cluster, group: Iterable[int], nbytes: float, *, algorithm: str | None = None) -> CommCost:
    """Every rank ends with the sum of all ranks' M-byte buffers.

    - ring: ``2(n-1) alpha + 2(n-1)/n * M/B``, alpha and B of the ring's slowest
      (most shared) link: per step every rank sends M/(nC) on each of C channels.
    - tree (double binary tree, each tree half of M, reduce then broadcast):
      ``2 floor(log2 n) alpha + 2 M/B`` on a switch.
    - hierarchical (same group size on every node, m per node, k nodes):
      reduce-scatter in each node ``(m-1)(alpha_in + M/(m B_in))``, then m concurrent
      ring all-reduces of the M/m shards across nodes ``2(k-1)(alpha_out + M/(mk B_out'))``
      (B_out' the NIC bandwidth shared by the shards on one NIC), then all-gather in
      each node (same as the reduce-scatter).
    """
    return collective("all_reduce", cluster, group, nbytes, algorithm=algorithm)


def all_gather(cluster: Cluster, group: Iterable[int], nbytes: float, *, algorithm: str | None = None) -> CommCost:
    """Every rank ends with all ranks' pieces; ``nbytes`` = M, the gathered size (each
    rank contributes M/n).

    - ring: ``(n-1) alpha + (n-1)/n * M/B`` (half of ring all-reduce).
    - tree (Bruck / recursive doubling): ``ceil(log2 n) alpha + (n-1)/n * M/B`` on a switch.
    - hierarchical: all-gather across nodes among same-position devices
      ``(k-1)(alpha_out + M/(n B_out'))``, then in each node ``(m-1)(alpha_in + M/(m B_in))``.
    """
    return collective("all_gather", cluster, group, nbytes, algorithm=algorithm)


def reduce_scatter(cluster: Cluster, group: Iterable[int], nbytes: float, *, algorithm: str | None = None) -> CommCost:
    """Every rank ends with 1/n of the sum; ``nbytes`` = M, each rank's input size.

    Same costs as :func:`all_gather` (the mirror algorithm): ring
    ``(n-1) alpha + (n-1)/n * M/B``; tree ``ceil(log2 n) alpha + (n-1)/n * M/B``;
    hierarchical reduce-scatters inside each node first, then across nodes.
    """
    return collective("reduce_scatter", cluster, group, nbytes, algorithm=algorithm)


def broadcast(
    cluster: Cluster, group: Iterable[int], nbytes: float, *, root: int | None = None, algorithm: str | None = None
) -> CommCost:
    """``root`` (default: the lowest device of the group) sends M bytes to every rank.

    - ring (pipelined chain): ``(n-1) alpha + M/B``.
    - tree (pipelined binary tree from the root; a parent feeds two children):
      ``floor(log2 n) alpha + 2 M/B`` on a switch.
    - hierarchical: chain across one leader per node ``(k-1) alpha_out + M/B_out``, then
      a chain inside every node ``(m-1) alpha_in + M/B_in`` (any group shape).
    """
    return collective("broadcast", cluster, group, nbytes, algorithm=algorithm, root=root)


def all_to_all(cluster: Cluster, group: Iterable[int], nbytes: float, *, algorithm: str | None = None) -> CommCost:
    """Each rank sends M/n of its M-byte buffer to every rank.

    - direct (all pairs at once, one message per peer):
      ``(n-1) alpha + (n-1)/n * M/B`` on a switch; across nodes the NICs carry every
      pair that leaves the node.
    - hierarchical (same group size m on every node): exchange inside each node so that
      each device holds what goes to its position on every node
      ``(m-1) alpha_in + (m-1)/m * M/B_in``, then exchange across nodes among
      same-position devices ``(k-1) alpha_out + (k-1)/k * M/B_out'``.
    """
    return collective("all_to_all", cluster, group, nbytes, algorithm=algorithm)


def parameter_server(
    cluster: Cluster, workers: Iterable[int], servers: int | Iterable[int], nbytes: float
) -> CommCost:
    """Push M-byte gradients from every worker to the server(s), then pull M bytes back.

    With s servers each holds an M/s shard ("ps-sharded"); a worker that is also a
    server does not send its own shard. Two phases, all transfers concurrent:
    ``2 alpha + 2 * max_l bytes(l)/B(l)``, which is ``2 alpha + 2 n M / B`` for one
    server on a switch (n workers besides the server) and ``2 alpha + 2 n M/(s B)``
    for s servers on separate ports.
    """
    w = _group(cluster, workers)
    s = _group(cluster, (servers,) if isinstance(servers, int) else servers)
    m = _check_bytes(nbytes)
    algorithm = "ps" if len(s) == 1 else "ps-sharded"
    push = tuple((a, b, 1 / len(s)) for a in w for b in s if a != b)
    return _cost("parameter_server", algorithm, _shape(cluster, [_Phase(1, 1, push), _Phase(1, 1, _flip(push))]), m)


def exchange(cluster: Cluster, transfers: Iterable[tuple[int, int, float]]) -> CommCost:
    """Concurrent point-to-point transfers ``(src, dst, nbytes)`` (a gossip step, a
    pipeline hand-off): ``max path latency + max_l bytes(l)/B(l)``."""
    items = []
    for src, dst, b in transfers:
        _group(cluster, (src,))
        _group(cluster, (dst,))
        items.append((src, dst, _check_bytes(b)))
    return _cost("exchange", "direct", _shape(cluster, [_Phase(1, 1, tuple(items))]), 1.0)


def p2p_time(cluster: Cluster, src: int, dst: int, nbytes: float) -> float:
    """One transfer alone: ``sum(latency over the path) + nbytes / min(bandwidth over
    the path)``; 0 for ``src == dst`` or 0 bytes."""
    m = _check_bytes(nbytes)
    path = cluster.path(src, dst)
    if not path or m == 0:
        return 0.0
    return sum(link.latency for link in path) + m / min(link.bandwidth for link in path)
