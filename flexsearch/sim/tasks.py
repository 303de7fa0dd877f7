"""Tasks and the list scheduler every simulator runs them through.

A :class:`Task` occupies resources (device ids ``< devices``, link indexes ``devices +
i``) for its duration once its dependencies are met. Dependencies are hashable keys
that earlier tasks *define*; a key defined by several tasks takes the latest end when
it is an accumulating key (a tuple tagged ``"G"``: a gradient that arrives in pieces),
else the last definition.

:func:`run_tasks` takes the tasks in the given order (each simulator emits them in an
order that respects every dependency and, per device, is the device's program order):
each starts once its dependencies have ended and its devices are free (a device runs its
tasks in the given order, one at a time, and holds it from start to end). A transfer or
collective then runs in the idle time its links have in common from then on: the links
serve the tasks listed before it first, and it uses every gap they leave, pausing over
their busy intervals, until its duration is served (:func:`_pieces`); it holds its
links for those pieces and ends with the last. So transfers queue on busy links and
overlap with compute on the devices, a transfer listed after a later one on the same
link takes the earlier gap (without that, a simulator that lists one pipeline rank's
later gradient transfer before another rank's earlier activation transfer on a shared
link would delay the activation: a 1F1B pipeline of balanced stages ran 10-30% slower
than ``(m + p - 1)(F + B)``), and a long transfer is not held back by short ones that
leave its links idle most of the time. Waiting for one gap of its whole duration
instead, an FSDP2 stage's 0.3 s all-gather on GPT 1T waited out the stage before's
warm-up (a 4 ms activation every 87 ms on the same links): the 32nd stage's first
forward started at 54 s instead of 12 s, the iteration 38% longer
(``tests/test_pipeline.py``). Links shared at once by transfers that overlap in time
would share their bandwidth; serving them in list order gives the ones listed first
the whole of it.

**Links loaded together.** On a cluster of many links (:data:`MERGE_LINKS_FROM` or more)
a collective over every device loads hundreds of them (GPT 18.4B on 256 A100s: 1,024
links per gradient all-reduce), and a pipeline's stage-to-stage transfer on GPT 1T over
3,072 A100s loads 16 (eight transfers in parallel, one per tensor-parallel rank), each
held and searched for a gap one by one. Links that every task so far loaded all of or
none of have the same busy intervals, so :func:`run_tasks` keeps the links in such
classes (:class:`LinkClasses`: one class of every link to start with, split by the
first task that loads part of one, the parts starting from copies of its intervals)
and schedules one link of each class a task loads: the same schedule, with the work of
a few links per task. The links of a class get its free time at the end. Classes
fixed over the whole schedule (links loaded by the same tasks) would keep a pipeline's
16 links apart from the start: the gradient all-reduces at the iteration's end load
each tensor-parallel rank's links apart.

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
    """A task with its start and end times (seconds) and, for a transfer that paused
    over others on its links (module docstring), the pieces ``(begin, end)`` it held its
    links for (empty: the whole of ``start`` to ``end``)."""

    task: Task
    start: float
    end: float
    pieces: tuple[tuple[float, float], ...] = ()


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


class LinkClasses:
    """The links of a schedule in classes that every task so far loaded all of or none
    of (module docstring), refined as :func:`run_tasks` meets the tasks. Each class has
    a resource index of its own past the links' (``devices + links + k``), whose busy
    intervals and free time stand for its links'; :meth:`held` gives a task's resources
    with one such index per class it loads, memoised per resources tuple (by ``id``:
    every simulator builds one tuple object per transfer or collective,
    :meth:`flexsearch.sim.context.CostContext.held`) while none of its classes has been
    split since. A split moves the smaller part to a new class, so each split costs the
    links it moves, not the class's (GPT 1T over 3,072 A100s has 24,576 links)."""

    def __init__(self, devices: int, links: int):
        self.devices = devices
        self.end = devices + links  # the first class's index
        self.of = list(range(devices)) + [self.end] * links  # per resource: its class
        self.members: dict[int, set[int]] = {self.end: set(range(devices, self.end))}
        self.version = [0] * (self.end + 1)  # per class index: bumped when the class splits
        self.memo: dict[int, list] = {}  # id(res) -> [held, ((class, version), ...), clock when checked]
        self.clock = 0  # splits so far

    def start(self, free: list[float]) -> None:
        """``free`` (per resource) with a free time for the first class."""
        free.append(0.0)

    def held(self, res: tuple[int, ...], busy: dict[int, tuple[list[float], list[float]]],
             free: list[float]) -> tuple[int, ...]:
        """``res`` with its links replaced by one class index per class, after splitting
        every class it loads part of (the smaller part to a new class, with a copy of the
        class's busy intervals in ``busy`` and its free time appended to ``free``)."""
        got = self.memo.get(id(res))
        if got is not None:
            if got[2] == self.clock:  # no class split since it was checked
                return got[0]
            version = self.version
            for c, v in got[1]:
                if version[c] != v:
                    break
            else:
                got[2] = self.clock
                return got[0]
        devices, of, members, version = self.devices, self.of, self.members, self.version
        devs: list[int] = []
        parts: dict[int, set[int]] = {}  # per class, the links of it res loads
        for r in res:
            if r < devices:
                devs.append(r)
            else:
                parts.setdefault(of[r], set()).add(r)
        classes = []
        for c, inside in parts.items():
            everyone = members[c]
            if len(inside) == len(everyone):
                classes.append(c)
                continue
            n = len(free)  # the new class's index
            small = inside if 2 * len(inside) <= len(everyone) else everyone.difference(inside)
            everyone -= small
            members[n] = small
            for r in small:
                of[r] = n
            self.clock += 1
            version[c] = self.clock
            version.append(self.clock)  # the new class's, at index n
            if c in busy:
                starts, ends = busy[c]
                busy[n] = (starts.copy(), ends.copy())
            free.append(free[c])
            classes.append(of[next(iter(inside))])
        out = (*devs, *classes)
        self.memo[id(res)] = [out, tuple((c, version[c]) for c in classes), self.clock]
        return out

    def spread(self, free: list[float]) -> None:
        """Every link's free time, its class's; the classes' own entries removed."""
        of = self.of
        for r in range(self.devices, self.end):
            free[r] = free[of[r]]
        del free[self.end:]

    def classes(self) -> list[tuple[int, ...]]:
        """The classes' links, each class's ascending, the classes by their least."""
        return sorted(tuple(sorted(m)) for m in self.members.values())


class PastCutoff(Exception):
    """:func:`run_tasks`' schedule is sure to end after its ``cutoff`` (module docstring)."""


def _accumulates(k: Key) -> bool:
    return type(k) is tuple and k[0] == "G"


def _pieces(busy: dict[int, tuple[list[float], list[float]]], resources: Sequence[int], devices: int,
            start: float, duration: float, free: Sequence[float]) -> list[tuple[float, float]]:
    """The idle time that every link among ``resources`` has in common from ``start`` on,
    in pieces ``(begin, end)`` that add up to ``duration``: what a transfer ready at
    ``start`` uses when the links serve the transfers listed before it first (module
    docstring). Each link's busy intervals are disjoint, sorted and not empty (so are
    the pieces: a gap or a rest within rounding, ``1e-9`` of ``duration`` plus a few
    units in the last place of the times, is not one); ``free``: per resource the end
    of its last interval (a link free by a time has no interval after). Each link's
    intervals are walked once, from the first that ends after ``start``; a link is
    dropped once the walk passes its last."""
    lists: list[tuple[list[float], list[float]]] = []
    at: list[int] = []  # per link: its first interval ending after start
    for r in resources:
        if r >= devices and free[r] > start:
            intervals = busy.get(r)
            if intervals is not None:
                lists.append(intervals)
                at.append(bisect.bisect_right(intervals[1], start))
    pieces: list[tuple[float, float]] = []
    left = duration
    tiny = duration * 1e-9 if duration < math.inf else 0.0
    while True:
        moved = True
        while moved:  # to the first time no link is busy at; ``nxt``: the next busy start
            moved = False
            nxt = math.inf
            done = False
            for k, (starts, ends) in enumerate(lists):
                i = at[k]
                if i < len(ends) and ends[i] <= start:
                    i = at[k] = bisect.bisect_right(ends, start, i + 1)
                if i == len(ends):
                    done = True
                elif starts[i] <= start:
                    start = ends[i]
                    moved = True
                elif starts[i] < nxt:
                    nxt = starts[i]
            if done:  # drop the links with no interval left
                kept = [k for k in range(len(lists)) if at[k] < len(lists[k][1])]
                lists, at = [lists[k] for k in kept], [at[k] for k in kept]
        slack = tiny + 4 * math.ulp(nxt)  # rounding: the duration's, and the times' own (inf at the end)
        if start + left <= nxt + slack:  # the rest fits, compared as end times (never a piece of nothing)
            pieces.append((start, min(start + left, nxt)))
            return pieces
        if nxt - start > slack:  # a gap of a rounding error is skipped
            pieces.append((start, nxt))
            left -= nxt - start
        start = nxt


def _hold(starts: list[float], ends: list[float], a: float, b: float) -> None:
    """Add the busy interval ``(a, b)`` to a link's sorted, disjoint ``starts``/``ends``,
    joined to an interval it touches (a transfer that fills a gap leaves one interval,
    not three: the lists stay as short as the link's idle gaps are many)."""
    if a >= ends[-1]:
        if a == ends[-1]:
            ends[-1] = b
        else:
            starts.append(a)
            ends.append(b)
        return
    i = bisect.bisect_left(starts, a)
    after = i < len(starts) and starts[i] == b
    if i and ends[i - 1] == a:
        if after:
            ends[i - 1] = ends[i]
            del starts[i], ends[i]
        else:
            ends[i - 1] = b
    elif after:
        starts[i] = a
    else:
        starts.insert(i, a)
        ends.insert(i, b)


def _occupy(busy: dict[int, tuple[list[float], list[float]]], free: list[float], res: Sequence[int], devices: int,
            start: float, dur: float) -> tuple[float, float, list[tuple[float, float]] | None]:
    """:func:`run_tasks`'s placement of a task on links (and devices) ready at ``start``:
    after its devices are free, in the idle time its links have in common from then on
    (:func:`_pieces`; ``busy``, ``free`` updated: :func:`_hold`); its start, its end and,
    when it paused, its pieces (else None)."""
    late = False
    for r in res:
        f = free[r]
        if f > start:
            if r < devices:
                start = f
            else:
                late = True
    pieces = None
    if late and dur > 0:
        pieces = _pieces(busy, res, devices, start, dur, free)
        start, stop = pieces[0][0], pieces[-1][1]
        if len(pieces) == 1:
            pieces = None
    else:
        stop = start + dur
    for r in res:
        if r >= devices and dur > 0:
            intervals = busy.get(r)
            if intervals is None:  # the pieces are apart (other links' busy time between them)
                spans = pieces or ((start, stop),)
                busy[r] = ([a for a, _ in spans], [b for _, b in spans])
            elif pieces is None:  # _hold, its commonest cases inline: at or after the link's last interval
                starts, ends = intervals
                last = ends[-1]
                if start > last:
                    starts.append(start)
                    ends.append(stop)
                elif start == last:
                    ends[-1] = stop
                else:
                    _hold(starts, ends, start, stop)
            else:
                for a, b in pieces:
                    _hold(*intervals, a, b)
        if stop > free[r]:
            free[r] = stop
    return start, stop, pieces


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
    classes = LinkClasses(devices, links) if links >= MERGE_LINKS_FROM else None
    free = [0.0] * (devices + links)
    if classes is not None:
        classes.start(free)
        memo_get = classes.memo.get
    busy: dict[int, tuple[list[float], list[float]]] = {}  # link -> (starts, ends) of its busy intervals
    end: dict = {}
    get = end.get
    timeline: list[Scheduled] = []
    compute = [0.0] * devices
    chain: dict = {}  # critical path: end times without resource waits
    serial = 0.0
    for t in ordered:
        kind, _, dur, res, deps, defines, _, _, copies = t
        got = None
        if classes is not None:  # LinkClasses.held, its memo's hit with no split since inlined
            got = memo_get(id(res))
            if got is not None:
                res = got[0] if got[2] == classes.clock else classes.held(res, busy, free)
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
            pieces = None
        else:
            if classes is not None and got is None:  # its first time
                res = classes.held(res, busy, free)
            start, stop, pieces = _occupy(busy, free, res, devices, start, dur)
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
            timeline.append(Scheduled(t, start, stop, tuple(pieces)) if pieces else Scheduled(t, start, stop))
            cstop = max([chain.get(k, 0.0) for k in deps], default=0.0) + dur
            for k in defines:
                if not _accumulates(k) or cstop > chain.get(k, 0.0):
                    chain[k] = cstop
    if classes is not None:
        classes.spread(free)
    return TaskRun(free, end, timeline, compute, chain, serial)
