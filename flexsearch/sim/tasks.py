"""Tasks and the list scheduler every simulator runs them through.

A :class:`Task` occupies resources (device ids ``< devices``, link indexes ``devices +
i``) for its duration once its dependencies are met. Dependencies are hashable keys
that earlier tasks *define*; a key defined by several tasks takes the latest end when
it is an accumulating key (a tuple tagged ``"G"``: a gradient that arrives in pieces),
else the last definition.

:func:`run_tasks` takes the tasks in the given order (each simulator emits them in an
order that respects every dependency): each starts at ``max(end of its
dependencies, free time of each of its resources)`` and holds all its resources until
it ends, so transfers queue on busy links and overlap with compute on the devices.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

Key = Hashable


@dataclass(frozen=True, slots=True)
class Task:
    """One task: ``kind`` in fwd/bwd/xfer/coll/update; ``resources`` are device ids
    (``< devices``) and link indexes (``devices + i``); ``deps`` keys it waits for;
    ``defines`` the keys it satisfies (module docstring)."""

    kind: str
    name: str
    duration: float
    resources: tuple[int, ...]
    deps: tuple[Key, ...]
    defines: tuple[Key, ...] = ()
    nbytes: float = 0.0
    detail: str = ""


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


def _accumulates(k: Key) -> bool:
    return type(k) is tuple and k[0] == "G"


def busy_compute(ordered: Sequence[Task], devices: int) -> list[float]:
    """Per device, the summed duration of the compute tasks it runs (forward, backward,
    update): a stage-level simulation's ``compute_s``."""
    compute = [0.0] * devices
    for t in ordered:
        if t.kind in ("fwd", "bwd", "update"):
            for d in t.resources:
                compute[d] += t.duration
    return compute


def run_tasks(ordered: Sequence[Task], devices: int, links: int, keep_timeline: bool = True) -> TaskRun:
    """List-schedule ``ordered`` (module docstring). Every plan kind's simulator
    schedules its tasks through this function."""
    free = [0.0] * (devices + links)
    end: dict = {}
    timeline: list[Scheduled] = []
    compute = [0.0] * devices
    chain: dict = {}  # critical path: end times without resource waits
    serial = 0.0
    for t in ordered:
        start = 0.0
        for k in t.deps:
            v = end.get(k)
            if v is not None and v > start:
                start = v
        for r in t.resources:
            if free[r] > start:
                start = free[r]
        stop = start + t.duration
        for r in t.resources:
            free[r] = stop
        for k in t.defines:
            if not _accumulates(k) or stop > end.get(k, 0.0):
                end[k] = stop
        if t.kind == "fwd" or t.kind == "bwd":
            compute[t.resources[0]] += t.duration
        serial += t.duration
        if keep_timeline:
            timeline.append(Scheduled(t, start, stop))
            cstop = max([chain.get(k, 0.0) for k in t.deps], default=0.0) + t.duration
            for k in t.defines:
                if not _accumulates(k) or cstop > chain.get(k, 0.0):
                    chain[k] = cstop
    return TaskRun(free, end, timeline, compute, chain, serial)
