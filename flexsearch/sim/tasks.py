"""Tasks and the list scheduler every simulator runs them through.

A :class:`Task` occupies resources (device ids ``< devices``, link indexes ``devices +
i``) for its duration once its dependencies are met. Dependencies are hashable keys
that earlier tasks *define*; a key defined by several tasks takes the latest end when
it is an accumulating key (a tuple tagged ``"G"``: a gradient that arrives in pieces),
else the last definition.

:func:`run_tasks` takes the tasks in the given order (each simulator emits them in an
order that respects every dependency and, per device, is the device's program order):
each starts once its dependencies have ended, its devices are free (a device runs its
tasks in the given order) and every link it loads has a gap for its whole duration (a
link serves transfers in time order, whatever order they were listed in: a transfer
listed after a later one on the same link takes an earlier gap), and holds all its
resources until it ends. So transfers queue on busy links and overlap with compute on
the devices. Without the gaps, a simulator that lists one pipeline rank's later
gradient transfer before another rank's earlier activation transfer on a shared link
would delay the activation (a 1F1B pipeline of balanced stages ran 10-30% slower than
``(m + p - 1)(F + B)``).

**Links loaded together.** On a cluster of many links (:data:`MERGE_LINKS_FROM` or more)
a collective over every device loads hundreds of them (GPT 18.4B on 256 A100s: 1,024
links per gradient all-reduce), each held and searched for a gap one by one. Links that
the same tasks load (every task loads all of them or none) have the same busy intervals
throughout the schedule, so :func:`run_tasks` schedules one of each such class
(:func:`link_classes`) and gives the others its free time at the end: the same
schedule, with the work of a few links per collective.

**Cutoff.** Given a ``cutoff`` time, :func:`run_tasks` stops with :class:`PastCutoff` as
soon as the schedule is sure to end after it: once some device ``d``, free at ``free[d]``
after a compute task, still has compute tasks of total duration ``left[d]`` to run
(forward and backward tasks, which a device runs one at a time), the schedule cannot
end before ``free[d] + left[d]``. A search that rejects every plan slower than some time
(:func:`flexsearch.search.mcmc.mcmc`) is then spared the rest of such a plan's schedule.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

Key = Hashable


class Task(NamedTuple):
    """One task: ``kind`` in fwd/bwd/xfer/coll/update; ``resources`` are device ids
    (``< devices``) and link indexes (``devices + i``); ``deps`` keys it waits for;
    ``defines`` the keys it satisfies (module docstring). ``copies``: how many identical
    tasks on other replicas it stands for in a simulation of one replica (the
    op-level simulator's replica quotient, :mod:`flexsearch.sim.simulator`); it counts
    that many times in ``serial``. A named tuple: immutable, and built four times
    faster than a frozen dataclass (a pipeline of 64 stages and 512 microbatches is
    130,000 tasks); change one with ``task._replace(...)``."""

    kind: str
    name: str
    duration: float
    resources: tuple[int, ...]
    deps: tuple[Key, ...]
    defines: tuple[Key, ...] = ()
    nbytes: float = 0.0
    detail: str = ""
    copies: int = 1


@dataclass(frozen=True)
class Scheduled:
    """A task with its start and end times (seconds)."""

    task: Task
    start: float
    end: float


@dataclass
class TaskRun:
    """The state list scheduling leaves: per resource its free time, per key its end
    time, per device its busy compute time, the timeline and the critical-path ends."""

    free: list[float]
    end: dict
    timeline: list[Scheduled]
    compute: list[float]
    chain: dict
    serial: float


MERGE_LINKS_FROM = 64
"""Links from which :func:`run_tasks` merges the links loaded together (module
docstring). Below it (8 H100s have 16) a collective loads few links and there is little
to merge: delta simulations of GPT-2 small with random SOAP decisions on 8 and on 16
H100s took the same time with and without merging, within this host's noise."""


def link_classes(ordered: Sequence[Task], devices: int) -> tuple[dict[int, tuple[int, ...]], dict[int, int]]:
    """The links ``ordered`` loads, in classes of links that every task loads all of or
    none of (module docstring): per resources tuple of a task that loads links (by
    ``id``), the tuple with one link of each class it holds (the class's least), and per
    link merged into another, that one. Both empty when no two links are loaded together."""
    tuples: dict[int, tuple[int, ...]] = {}
    for t in ordered:
        res = t[3]
        if id(res) not in tuples and res and max(res) >= devices:
            tuples[id(res)] = res
    loaded: dict[int, list[int]] = {}  # link -> the tuples that hold it
    for k, res in enumerate(tuples.values()):
        for r in res:
            if r >= devices:
                loaded.setdefault(r, []).append(k)
    classes: dict[tuple[int, ...], list[int]] = {}
    for r, ks in loaded.items():
        classes.setdefault(tuple(ks), []).append(r)
    merged: dict[int, int] = {}
    for members in classes.values():
        first = min(members)
        merged.update((r, first) for r in members if r != first)
    if not merged:
        return {}, {}
    return {i: tuple(r for r in res if r not in merged) for i, res in tuples.items()}, merged


class PastCutoff(Exception):
    """:func:`run_tasks`' schedule is sure to end after its ``cutoff`` (module docstring)."""


def _accumulates(k: Key) -> bool:
    return type(k) is tuple and k[0] == "G"


def _gap(busy: dict[int, tuple[list[float], list[float]]], resources: Sequence[int], devices: int,
         start: float, duration: float, free: Sequence[float]) -> float:
    """The earliest time ``>= start`` at which every link among ``resources`` is idle for
    ``duration`` (their busy intervals are disjoint and sorted; ``free``: per resource
    the end of its last interval, a link free by ``start`` is skipped)."""
    moved = True
    while moved:
        moved = False
        for r in resources:
            if r < devices or free[r] <= start or r not in busy:
                continue
            starts, ends = busy[r]
            i = bisect.bisect_right(ends, start)
            while i < len(starts) and starts[i] < start + duration:
                start = ends[i]
                moved = True
                i += 1
    return start


def _occupy(busy: dict[int, tuple[list[float], list[float]]], free: list[float], res: Sequence[int], devices: int,
            start: float, dur: float) -> float:
    """:func:`run_tasks`'s placement of a task on links (and devices) ready at ``start``:
    after its devices are free, in the first gap of every link it loads (``busy``, ``free``
    updated); its start."""
    late = False
    for r in res:
        f = free[r]
        if f > start:
            if r < devices:
                start = f
            else:
                late = True
    if late and dur > 0:
        start = _gap(busy, res, devices, start, dur, free)
    stop = start + dur
    for r in res:
        if r >= devices and dur > 0:
            intervals = busy.get(r)
            if intervals is None:
                busy[r] = ([start], [stop])
            else:
                starts, ends = intervals
                if start >= ends[-1]:
                    starts.append(start)
                    ends.append(stop)
                else:
                    i = bisect.bisect_left(starts, start)
                    starts.insert(i, start)
                    ends.insert(i, stop)
        if stop > free[r]:
            free[r] = stop
    return start


def busy_compute(ordered: Sequence[Task], devices: int,
                 kinds: tuple[str, ...] = ("fwd", "bwd", "update")) -> list[float]:
    """Per device, the summed duration of the compute tasks of ``kinds`` it runs
    (forward, backward, update): a stage-level simulation's ``compute_s``."""
    compute = [0.0] * devices
    for t in ordered:
        if t.kind in kinds:
            for d in t.resources:
                compute[d] += t.duration
    return compute


def run_tasks(ordered: Sequence[Task], devices: int, links: int, keep_timeline: bool = True,
              cutoff: float = math.inf) -> TaskRun:
    """List-schedule ``ordered`` (module docstring). Every plan kind's simulator
    schedules its tasks through this function (the delta simulation's inner loop: the
    attribute and method lookups are hoisted, the key test of :func:`_accumulates`
    inlined). Raises :class:`PastCutoff` once the schedule is sure to end after
    ``cutoff`` (module docstring)."""
    bounded = cutoff < math.inf
    left = busy_compute(ordered, devices, ("fwd", "bwd")) if bounded else []  # compute still to run per device
    held, merged = link_classes(ordered, devices) if links >= MERGE_LINKS_FROM else ({}, {})
    free = [0.0] * (devices + links)
    busy: dict[int, tuple[list[float], list[float]]] = {}  # link -> (starts, ends) of its busy intervals
    end: dict = {}
    get = end.get
    timeline: list[Scheduled] = []
    compute = [0.0] * devices
    chain: dict = {}  # critical path: end times without resource waits
    serial = 0.0
    for t in ordered:
        kind, _, dur, res, deps, defines, _, _, copies = t
        if held:
            res = held.get(id(res), res)
        start = 0.0
        for k in deps:
            v = get(k)
            if v is not None and v > start:
                start = v
        if res and max(res) < devices:  # on devices alone (compute): each free when it starts
            for r in res:
                f = free[r]
                if f > start:
                    start = f
            stop = start + dur
            for r in res:
                free[r] = stop
        else:
            start = _occupy(busy, free, res, devices, start, dur)
            stop = start + dur
        for k in defines:
            if type(k) is not tuple or k[0] != "G":  # not _accumulates(k): the last definition
                end[k] = stop
            else:
                v = get(k)
                if v is None or stop > v:
                    end[k] = stop
        if kind == "fwd" or kind == "bwd":
            compute[res[0]] += dur
            if bounded:
                for r in res:
                    left[r] -= dur
                    if free[r] + left[r] > cutoff:
                        raise PastCutoff
        serial += dur * copies
        if keep_timeline:
            timeline.append(Scheduled(t, start, stop))
            cstop = max([chain.get(k, 0.0) for k in deps], default=0.0) + dur
            for k in defines:
                if not _accumulates(k) or cstop > chain.get(k, 0.0):
                    chain[k] = cstop
    for r, first in merged.items():  # a link merged into another: its free time
        free[r] = free[first]
    return TaskRun(free, end, timeline, compute, chain, serial)
