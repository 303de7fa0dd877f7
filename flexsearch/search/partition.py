"""PipeDream's pipeline partitioner: stage boundaries and a replication factor per stage.

**Input.** A :class:`Chain` of ``L`` layers between legal cut points (for a DAG, the
prefixes of its topological order, :func:`flexsearch.search.pipeline.layer_chain`):
per layer its compute time ``c_l`` (forward + backward of one minibatch on one device),
parameter bytes ``w_l`` and activation bytes kept for the backward pass; per cut point
``x`` (between layers ``x-1`` and ``x``) the bytes ``a_x`` of the tensors that cross it.
The cluster is a hierarchy of :class:`Level`\\ s, innermost first: level 0 groups
``n_0`` devices into a machine (a server) over links of bandwidth ``B_0`` and latency
``alpha_0``, level 1 groups ``n_1`` such machines, and so on.

**Recurrence** (REFERENCE section 2, PipeDream's optimizer, hierarchical). ``A_k(i..j)``
is the time of the slowest stage of the best pipeline of layers ``i..j`` on one level-k
machine (``n_k`` level-(k-1) machines); ``A_{-1}(i..j) = sum c_l`` (one device).
A stage ``i..j`` on ``r`` of the level's machines costs

    T_k(i..j, r) = max( A_{k-1}(i..j) / r,  sync_k(sum w_l, r) ),
    sync_k(W, r) = 2 (r-1) alpha_k + 2 (r-1)/r * W / B_k       (ring all-reduce; 0 if r = 1)

(compute split over the replicas, overlapped with the all-reduce of the stage's weight
gradients: the "max" variant, PipeDream's paper formula; with ``alpha = 0`` it is
exactly ``(1/r) max(compute, 2 (r-1) |w| / B)``). A cut after layer ``s`` costs
``2 (alpha_k + a_s / B_k)`` (activations forward, gradients backward), and

    A_k(i..j, m) = min( T_k(i..j, m),  min_{s, m'} max( A_k(i..s, m-m'), 2 (alpha_k + a_s / B_k),
                                                         T_k(s+1..j, m') ) ),

with ``A_k(i..j) = A_k(i..j, n_k)``; the answer is ``A_top(0..L)``. Two deliberate
differences from the paper's text, both in the brute-force tests' definition too: a
pipeline may leave machines idle (``m' + ... <= m`` rather than ``= m``: with the
all-reduce term, more replicas can be slower), and a device stage must fit in memory
(:class:`Memory`: weights times a factor, stashed weight versions, and the activations
of the minibatches in flight, which depend on the stage's total replica count).
``replicate=False`` gives a straight pipeline (``r = 1`` at every level).

**Algorithm** (exact, not the O(L^3 m^2) table). Every stage cost is monotone under
shrinking the layer range, so for a target bottleneck ``X`` the best pipelines are
greedy: from position ``s``, with ``w`` machines left, a stage on ``r`` machines
reaches at most ``last_r(s)`` = the furthest position with ``T_k <= X`` (found by
binary search on prefix sums, vectorised over all ``s``) and should end at the last
*allowed* cut (``2 (alpha + a / B) <= X``) before it. ``e_w(s)``, the furthest position
``w`` machines cover from ``s``, satisfies

    e_0(s) = s,   e_w(s) = max( e_{w-1}(s), last_w(s), max_{r < w} e_{w-r}(cut_r(s)) ),

and ``A_{k-1}(i..j) <= r X`` iff a level-(k-1) machine's reach at bottleneck ``r X``
from ``i`` is at least ``j``: the levels nest by evaluating the inner reach at the
scaled target. ``X`` is feasible iff ``e_{n_top}(0) >= L``; the optimum is found by
bisection on ``X`` (to relative precision 1e-12), the stages by retracing the choices.
One feasibility test costs ``O(prod_k n_k^2 * L log L)`` vectorised operations.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np


@dataclass(frozen=True)
class Level:
    """One level of the device hierarchy: ``workers`` machines of the level below (devices
    at level 0), connected by links of ``bandwidth`` bytes/s and ``latency`` seconds."""

    workers: int
    bandwidth: float
    latency: float = 0.0

    def __post_init__(self) -> None:
        if self.workers < 1 or not self.bandwidth > 0 or self.latency < 0:
            raise ValueError(f"bad level {self}: need workers >= 1, bandwidth > 0, latency >= 0")

    def sync(self, nbytes: float, r: int) -> float:
        """Ring all-reduce time of ``nbytes`` of gradients over ``r`` replicas."""
        if r <= 1:
            return 0.0
        return 2 * (r - 1) * self.latency + 2 * (r - 1) / r * nbytes / self.bandwidth

    def cut(self, nbytes: float) -> float:
        """Activations forward plus gradients backward across a cut."""
        return 2 * (self.latency + nbytes / self.bandwidth)


@dataclass(frozen=True)
class Chain:
    """Layers between legal cut points (module docstring). ``cut_bytes`` has ``L + 1``
    entries, one per position; the first and last (the chain's ends) are not cuts; an
    infinite one is a position no cut may take (no transfer time allows it:
    :func:`flexsearch.sim.stages.written_through_views`)."""

    compute: tuple[float, ...]
    params: tuple[float, ...]
    cut_bytes: tuple[float, ...]
    stash: tuple[float, ...] = ()
    names: tuple[str, ...] = ()
    frozen: tuple[float, ...] = ()
    """Per layer, the bytes of frozen parameters besides ``params`` (those that train,
    whose gradients are all-reduced): held once, without gradient or optimizer state
    (:attr:`Memory.frozen_factor`)."""

    def __post_init__(self) -> None:
        n = len(self.compute)
        if n == 0:
            raise ValueError("a chain needs at least one layer")
        if len(self.params) != n or len(self.cut_bytes) != n + 1:
            raise ValueError("chain arrays disagree: params needs L entries, cut_bytes L + 1")
        if self.stash and len(self.stash) != n:
            raise ValueError("chain stash needs one entry per layer")
        if self.frozen and len(self.frozen) != n:
            raise ValueError("chain frozen needs one entry per layer")
        for name in ("compute", "params", "stash", "frozen"):
            values = np.asarray(getattr(self, name), dtype=float)
            if not (np.isfinite(values).all() and (values >= 0).all()):
                raise ValueError(f"chain {name} must be finite and >= 0")
        if not (np.asarray(self.cut_bytes, dtype=float) >= 0).all():  # infinite: no boundary there
            raise ValueError("chain cut_bytes must be >= 0")

    @property
    def layers(self) -> int:
        return len(self.compute)

    @cached_property
    def prefix_sums(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Prefix sums (``L + 1`` entries from 0, read-only) of ``compute``, ``params``,
        ``stash`` and ``frozen`` (zeros where empty): computed once per chain, for every
        partition of it (the pipeline search partitions one chain thousands of times)."""
        out = []
        for values in (self.compute, self.params, self.stash, self.frozen):
            pre = np.zeros(self.layers + 1)
            if values:
                np.cumsum(np.asarray(values, dtype=float), out=pre[1:])
            pre.flags.writeable = False
            out.append(pre)
        return tuple(out)

    @cached_property
    def cut_array(self) -> np.ndarray:
        """``cut_bytes`` as a read-only array, computed once per chain."""
        cuts = np.asarray(self.cut_bytes, dtype=float)
        cuts.flags.writeable = False
        return cuts


@dataclass(frozen=True)
class Memory:
    """Per-device memory rule of a stage replica holding layers with ``W`` parameter
    bytes that train, ``F`` frozen and ``S`` stashed activation bytes (per minibatch),
    with ``q = in_flight(replicas)`` minibatches in flight:
    ``W * (weight_factor + (q - 1 if weight_stashing else 0)) + F * frozen_factor + S * q <= capacity``."""

    capacity: float
    weight_factor: float
    in_flight: Callable[[int], int] = field(default=lambda r: 1)
    weight_stashing: bool = False
    frozen_factor: float = 1.0

    def per_replica(self, replicas: int) -> tuple[float, float]:
        """(bytes per parameter byte, bytes per stashed activation byte)."""
        q = max(1, int(self.in_flight(replicas)))
        return self.weight_factor + (q - 1 if self.weight_stashing else 0), float(q)


@dataclass(frozen=True)
class Stage:
    """Layers ``start..end-1`` on ``replicas`` machines of one level; ``inner`` is the
    pipeline each of those machines runs (empty at level 0, where machines are devices)."""

    start: int
    end: int
    replicas: int
    inner: tuple[Stage, ...] = ()


@dataclass(frozen=True)
class DeviceStage:
    """A flattened stage: layers ``start..end-1`` replicated on ``devices``."""

    start: int
    end: int
    devices: tuple[int, ...]

    @property
    def replicas(self) -> int:
        return len(self.devices)


@dataclass(frozen=True)
class Partitioning:
    """The partitioner's answer: the nested stages, the bottleneck ``A_top(0..L)``."""

    stages: tuple[Stage, ...]
    bottleneck_s: float
    levels: tuple[Level, ...]

    def device_stages(self) -> tuple[DeviceStage, ...]:
        """Stages over device ids (machines numbered in order, devices within a machine
        consecutively), merged across the replicas of enclosing stages."""
        sizes = [1]
        for lv in self.levels:
            sizes.append(sizes[-1] * lv.workers)
        merged: dict[tuple[int, int], list[int]] = {}

        def walk(stages: tuple[Stage, ...], k: int, base: int) -> None:
            offset = base
            for st in stages:
                for i in range(st.replicas):
                    first = offset + i * sizes[k]
                    if k == 0:
                        merged.setdefault((st.start, st.end), []).append(first)
                    else:
                        walk(st.inner, k - 1, first)
                offset += st.replicas * sizes[k]

        walk(self.stages, len(self.levels) - 1, 0)
        return tuple(DeviceStage(a, b, tuple(sorted(d))) for (a, b), d in sorted(merged.items()))

    def text(self) -> str:
        """PipeDream's notation: replicas per device stage, e.g. ``"15-1"``."""
        return "-".join(str(s.replicas) for s in self.device_stages())


def pipeline_time(chain: Chain, levels: Sequence[Level], stages: Sequence[Stage], *,
                  memory: Memory | None = None, k: int | None = None, rep: int = 1) -> float:
    """``A_k`` of a given nested pipeline, straight from the recurrence's definition
    (``inf`` if a device stage does not fit); the brute-force check and reports use it."""
    k = len(levels) - 1 if k is None else k
    level = levels[k]
    worst = 0.0
    for i, st in enumerate(stages):
        if i:
            worst = max(worst, level.cut(chain.cut_bytes[st.start]))
        weights = float(sum(chain.params[st.start:st.end]))
        if k == 0:
            inner = float(sum(chain.compute[st.start:st.end]))
            if memory is not None:
                wf, sf = memory.per_replica(rep * st.replicas)
                stash = float(sum(chain.stash[st.start:st.end])) if chain.stash else 0.0
                frozen = float(sum(chain.frozen[st.start:st.end])) if chain.frozen else 0.0
                if weights * wf + frozen * memory.frozen_factor + stash * sf > memory.capacity:
                    return float("inf")
        else:
            inner = pipeline_time(chain, levels, st.inner, memory=memory, k=k - 1, rep=rep * st.replicas)
        worst = max(worst, inner / st.replicas, level.sync(weights, st.replicas))
    return worst


class _Solver:
    """The bisection and reach arrays of the module docstring."""

    def __init__(self, chain: Chain, levels: Sequence[Level], memory: Memory | None, replicate: bool):
        self.chain, self.levels, self.memory, self.replicate = chain, tuple(levels), memory, replicate
        n = chain.layers
        self.idx = np.arange(n + 1)
        self.cpre, self.wpre, self.spre, self.fpre = chain.prefix_sums
        self.cuts = chain.cut_array
        self._info: dict[tuple, dict] = {}

    def _furthest(self, pre: np.ndarray, limit: float) -> np.ndarray:
        """Per start s, the furthest e >= s with pre[e] - pre[s] <= limit."""
        if limit == np.inf or np.isnan(limit):
            return np.full_like(self.idx, len(pre) - 1)
        e = np.searchsorted(pre, pre + limit * (1 + 1e-12), side="right") - 1
        return np.maximum(e, self.idx)

    def _device(self, x: float, rep: int) -> np.ndarray:
        e = self._furthest(self.cpre, x)
        if self.memory is not None:
            wf, sf = self.memory.per_replica(rep)
            held = self.wpre * wf + self.fpre * self.memory.frozen_factor + self.spre * sf
            e = np.minimum(e, self._furthest(held, self.memory.capacity))
        return e

    def reach(self, k: int, x: float, rep: int) -> np.ndarray:
        """Per start position, the furthest position one level-k machine covers."""
        if k < 0:
            return self._device(x, rep)
        return self.info(k, x, rep)["e"][-1]

    def info(self, k: int, x: float, rep: int) -> dict:
        key = (k, x, rep)
        hit = self._info.get(key)
        if hit is not None:
            return hit
        level = self.levels[k]
        n = level.workers
        rs = range(1, n + 1) if self.replicate else range(1, 2)
        allowed = np.zeros(len(self.idx), dtype=bool)
        allowed[1:-1] = 2 * (level.latency + self.cuts[1:-1] / level.bandwidth) <= x * (1 + 1e-12)
        prev_allowed = np.maximum.accumulate(np.where(allowed, self.idx, -1))
        last: dict[int, np.ndarray] = {}
        cut: dict[int, np.ndarray] = {}
        for r in rs:
            e = self.reach(k - 1, r * x, rep * r)
            if r > 1:
                budget = x - 2 * (r - 1) * level.latency
                if budget < 0:
                    e = self.idx.copy()
                else:
                    e = np.minimum(e, self._furthest(self.wpre, budget * r * level.bandwidth / (2 * (r - 1))))
            last[r] = e
            cut[r] = np.maximum(prev_allowed[e], self.idx)
        reach = [self.idx]
        for w in range(1, n + 1):
            best = reach[w - 1]
            if w in last:
                best = np.maximum(best, last[w])
            for r in rs:
                if r < w:
                    best = np.maximum(best, reach[w - r][cut[r]])
            reach.append(best)
        hit = self._info[key] = {"e": reach, "last": last, "cut": cut, "rs": rs}
        if len(self._info) > 4096:
            self._info.clear()
            self._info[key] = hit
        return hit

    def feasible(self, x: float) -> bool:
        self._info.clear()
        if len(self.levels) == 1 and not self.replicate:
            return self._straight(x)
        return bool(self.reach(len(self.levels) - 1, x, 1)[0] >= self.chain.layers)

    def _straight(self, x: float) -> bool:
        """:meth:`feasible` for a straight pipeline on one level, without the arrays of
        every start: with one replica per stage the recurrence is ``reach_w(s) =
        max(reach_{w-1}(s), reach_{w-1}(cut(s)))``; ``reach_1 = e`` and ``cut`` are
        non-decreasing and ``cut(s) >= s``, so ``reach_w(s) = e(cut^{w-1}(s))``: a walk of
        ``w - 1`` cuts from position 0 (the same array entries :meth:`info` reads)."""
        level = self.levels[0]
        e = self.reach(-1, x, 1)
        allowed = np.zeros(len(self.idx), dtype=bool)
        allowed[1:-1] = 2 * (level.latency + self.cuts[1:-1] / level.bandwidth) <= x * (1 + 1e-12)
        prev_allowed = np.maximum.accumulate(np.where(allowed, self.idx, -1))
        s = 0
        for _ in range(level.workers - 1):
            if e[s] >= self.chain.layers:
                return True
            s = max(int(prev_allowed[e[s]]), s)
        return bool(e[s] >= self.chain.layers)

    def build(self, k: int, x: float, rep: int, s: int, target: int) -> tuple[Stage, ...]:
        """Retrace one level-k machine's pipeline over ``s..target``."""
        info = self.info(k, x, rep)
        w = self.levels[k].workers
        stages: list[Stage] = []
        while s < target:
            step = None
            for r in info["rs"]:
                if r > w:
                    break
                if info["last"][r][s] >= target:
                    step = (r, target)
                    break
                c = int(info["cut"][r][s])
                if r < w and c > s and info["e"][w - r][c] >= target:
                    step = (r, c)
                    break
            if step is None:
                w -= 1
                if w < 1:
                    raise AssertionError("partition retrace lost its way")
                continue
            r, end = step
            inner = () if k == 0 else self.build(k - 1, r * x, rep * r, s, end)
            stages.append(Stage(s, end, r, inner))
            s, w = end, w - r
        return tuple(stages)


def partition(chain: Chain, levels: Sequence[Level], *, memory: Memory | None = None,
              replicate: bool = True) -> Partitioning | None:
    """The optimal pipeline of ``chain`` on the hierarchy ``levels`` (module docstring),
    or ``None`` when no partition fits in memory."""
    if not levels:
        raise ValueError("partition needs at least one level")
    solver = _Solver(chain, levels, memory, replicate)
    if not solver.feasible(np.inf):
        return None
    hi = max(float(solver.cpre[-1]), 1e-12)
    while not solver.feasible(hi):
        hi *= 2
    lo = 0.0
    for _ in range(200):
        if hi - lo <= 1e-12 * hi:
            break
        mid = (lo + hi) / 2
        if solver.feasible(mid):
            hi = mid
        else:
            lo = mid
    solver.feasible(hi)
    top = len(levels) - 1
    stages = solver.build(top, hi, 1, 0, chain.layers)
    value = pipeline_time(chain, levels, stages, memory=memory)
    return Partitioning(stages, value, tuple(levels))
