"""The list scheduler: a transfer uses the idle time its links have in common (the
transfers listed before it first); links loaded together are scheduled as one, with the
same result."""

from __future__ import annotations

import contextlib
import functools
import math
import sys

import pytest
from conftest import ROOT
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(ROOT / "benchmarks"))
import zoo  # noqa: E402

import flexsearch.sim.tasks as tasks  # noqa: E402
from flexsearch import Cluster, trace  # noqa: E402
from flexsearch.sim.simulator import Simulator  # noqa: E402
from flexsearch.sim.tasks import LinkClasses, Task, run_tasks  # noqa: E402
from flexsearch.strategy import recipes  # noqa: E402
from flexsearch.strategy.space import Space  # noqa: E402

DEVICES, LINKS = 3, 70


@st.composite
def task_lists(draw):
    """Tasks in an order their dependencies allow: compute on one device, and transfers
    and collectives over one of a few link sets (so that links fall into classes, and
    sets that overlap split them), some holding devices too; keys defined once or,
    tagged ``"G"``, accumulated."""
    patterns = [tuple(sorted(draw(st.sets(st.integers(DEVICES, DEVICES + LINKS - 1), min_size=1, max_size=LINKS))))
                for _ in range(draw(st.integers(1, 4)))]
    out, keys = [], []
    for i in range(draw(st.integers(1, 40))):
        deps = tuple(draw(st.lists(st.sampled_from(keys), max_size=3, unique=True))) if keys else ()
        key = ("G", i % 3) if draw(st.booleans()) and i % 4 == 0 else ("k", i)
        dur = draw(st.sampled_from([0.0, 1.0, 0.5, 2.0, 3.25]))
        if draw(st.booleans()):
            out.append(Task("fwd" if i % 2 else "bwd", f"t{i}", dur, (draw(st.integers(0, DEVICES - 1)),), deps,
                            (key,)))
        else:
            devs = tuple(sorted(draw(st.sets(st.integers(0, DEVICES - 1), max_size=2))))
            out.append(Task(draw(st.sampled_from(["xfer", "coll"])), f"t{i}", dur,
                            devs + draw(st.sampled_from(patterns)), deps, (key,)))
        keys.append(key)
    return out


@contextlib.contextmanager
def merging(on: bool):
    """Links loaded together merged as :func:`run_tasks` does (``on``), or each scheduled."""
    before = tasks.MERGE_LINKS_FROM
    tasks.MERGE_LINKS_FROM = before if on else 10**9
    try:
        yield
    finally:
        tasks.MERGE_LINKS_FROM = before


def _run(ordered, devices, links, merge: bool):
    with merging(merge):
        return run_tasks(ordered, devices, links)


@settings(max_examples=200, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(task_lists())
def test_links_loaded_together_schedule_as_one(ordered):
    """Scheduling one link of each class (:class:`LinkClasses`) gives every task the
    times, and every resource the free time, of scheduling each link."""
    assert LINKS >= tasks.MERGE_LINKS_FROM
    merged = _run(ordered, DEVICES, LINKS, True)
    each = _run(ordered, DEVICES, LINKS, False)
    assert [(s.task, s.start, s.end) for s in merged.timeline] == [(s.task, s.start, s.end) for s in each.timeline]
    assert (merged.free, merged.end, merged.compute, merged.chain, merged.serial) == \
        (each.free, each.end, each.compute, each.chain, each.serial)


def test_a_transfer_uses_the_idle_time_between_the_transfers_listed_before_it():
    """Two devices, links 2 and 3: 1 s transfers on link 2 at 0, 10 and 20 (listed first;
    device 0's waits time them), then a 25 s one ready at 0.5 (device 1's task) runs in
    the gaps, 1-10, 11-20 and 21-28, and ends at 28, where a rule that waits for a gap
    of its whole duration would end it at 46. A transfer listed after it, ready at 0,
    waits for the link until 28; one over links 2 and 3 runs when both are idle."""
    ordered = [Task("fwd", "w1", 10.0, (0,), (), (("k", 1),)), Task("fwd", "w2", 10.0, (0,), (), (("k", 2),))]
    ordered += [Task("xfer", f"s{i}", 1.0, (2,), (("k", i),) if i else (), (("s", i),)) for i in range(3)]
    ordered += [Task("fwd", "ready", 0.5, (1,), (), (("r",),)), Task("coll", "big", 25.0, (2,), (("r",),), (("b",),)),
                Task("xfer", "after", 0.5, (2,), (), (("a",),)), Task("xfer", "two", 1.0, (2, 3), (), (("c",),))]
    run = run_tasks(ordered, 2, 2)
    times = {s.task.name: (s.start, s.end) for s in run.timeline}
    assert [times[f"s{i}"] for i in range(3)] == [(0.0, 1.0), (10.0, 11.0), (20.0, 21.0)]
    assert times["big"] == (1.0, 28.0)
    assert [s.pieces for s in run.timeline if s.task.name in ("big", "after")] == \
        [((1.0, 10.0), (11.0, 20.0), (21.0, 28.0)), ()]
    assert times["after"] == (28.0, 28.5) and times["two"] == (28.5, 29.5)
    assert run.free == [20.0, 0.5, 29.5, 29.5]
    busy, free = {2: ([0.0, 10.0, 20.0], [1.0, 11.0, 21.0])}, [0.0, 0.0, 21.0, 0.0]
    assert tasks._occupy(busy, free, (2,), 2, 0.5, 25.0) == (1.0, 28.0, [(1.0, 10.0), (11.0, 20.0), (21.0, 28.0)])
    assert busy[2] == ([0.0], [28.0])  # the pieces fill the gaps: one interval


def test_a_transfer_that_fills_a_gap_exactly_is_not_split_by_rounding():
    """A 0.2 us transfer in the gap its link leaves from 20 s to the next transfer's start
    at ``20 + 2e-7`` (a device's end): the gap, as a difference of times near 20, falls
    short of 2e-7 by more than the duration's own rounding (``2e-7 * 1e-9``). It fits,
    compared as end times, as the old rule had it, not 20 to 20.0000002 and an empty
    piece after the 5 s transfer. And a transfer of infinite duration ends at inf."""
    t0, d = 20.0, 2e-7
    assert (t0 + d) - t0 < d - d * 1e-9
    ordered = [Task("xfer", "a", t0, (1,), (), ("a",)), Task("fwd", "f", t0 + d, (0,), (), ("f",)),
               Task("xfer", "b", 5.0, (1,), ("f",), ("b",)), Task("xfer", "c", d, (1,), (), ("c",))]
    times = {s.task.name: (s.start, s.end, s.pieces) for s in run_tasks(ordered, 1, 1).timeline}
    assert times["c"] == (t0, t0 + d, ())
    assert times["b"][:2] == (t0 + d, t0 + d + 5.0)
    ordered = [Task("xfer", "a", 1.0, (1,), (), ("a",)), Task("xfer", "b", math.inf, (1,), (), ("b",))]
    assert [(s.start, s.end) for s in run_tasks(ordered, 1, 1).timeline] == [(0.0, 1.0), (1.0, math.inf)]


@settings(max_examples=200, derandomize=True, deadline=None, database=None)
@given(st.lists(st.tuples(st.sets(st.integers(1, 4), min_size=1), st.sampled_from([0.0, 0.5, 1.0, 2.5, 7.0]),
                          st.sampled_from([0.0, 0.25, 1.0, 3.0])), max_size=30))
def test_links_serve_transfers_in_list_order_without_idling(placements):
    """Transfers placed one after another (links 1-4 of one device, each ready at some
    time): every link's busy intervals stay sorted and disjoint (those that touch
    joined), a transfer adds its duration to each of its links' busy time, and from when
    it is ready until it ends one of its links is busy at every moment (the links never
    idle while it waits)."""
    busy, free = {}, [0.0] * 5

    def busy_at(r: int, x: float) -> bool:
        starts, ends = busy.get(r, ([], []))
        return any(a <= x < b for a, b in zip(starts, ends, strict=True))

    for links, ready, dur in placements:
        res = tuple(sorted(links))
        before = {r: sum(b - a for a, b in zip(*busy.get(r, ([], [])), strict=True)) for r in res}
        start, stop, pieces = tasks._occupy(busy, free, res, 1, ready, dur)
        assert pieces is None or (len(pieces) > 1 and sum(b - a for a, b in pieces) == pytest.approx(dur)
                                  and (pieces[0][0], pieces[-1][1]) == (start, stop))
        assert start >= ready and stop >= start + dur - 1e-12
        for r in res:
            starts, ends = busy.get(r, ([], []))
            assert all(a < b for a, b in zip(starts, ends, strict=True))
            assert all(b < a for b, a in zip(ends, starts[1:], strict=False))  # intervals that touch are joined
            assert sum(b - a for a, b in zip(starts, ends, strict=True)) == pytest.approx(before[r] + dur)
            assert free[r] >= max(ends, default=0.0)
        if dur > 0:
            cuts = sorted({ready, stop, *(x for r in res for x in (*busy[r][0], *busy[r][1]) if ready < x < stop)})
            assert all(any(busy_at(r, (a + b) / 2) for r in res) for a, b in zip(cuts, cuts[1:], strict=False))


def classes_of(ordered, devices: int, links: int) -> list[tuple[int, ...]]:
    """The link classes :func:`run_tasks` ends with on ``ordered``: each link task's
    resources through :meth:`LinkClasses.held`, in order."""
    cl, busy, free = LinkClasses(devices, links), {}, [0.0] * (devices + links)
    cl.start(free)
    for t in ordered:
        if t.resources and max(t.resources) >= devices:
            cl.held(t.resources, busy, free)
    return cl.classes()


def test_link_classes_split_where_a_task_loads_part_of_a_class():
    """Links 4-13 of a 4-device schedule: one class (index 14) to start with; a
    collective loading 10-13 (and device 0) splits them off to class 15 (the smaller
    part moves), a transfer over 11 and 12 splits those off to 16. A task's links become
    one index per class, its devices kept; the part split off starts from a copy of the
    class's busy intervals and free time; at the end every link takes its class's free
    time."""
    a = (0, 10, 11, 12, 13)
    b = (11, 12)
    cl, busy = LinkClasses(4, 10), {}
    free = [0.0] * 14
    cl.start(free)
    assert cl.held(a, busy, free) == (0, 15)
    busy[15] = ([1.0], [2.0])
    free[15] = 2.0
    assert cl.held(b, busy, free) == (16,)
    assert busy[16] == ([1.0], [2.0]) and busy[16][0] is not busy[15][0] and free[16] == 2.0
    assert cl.held(a, busy, free) == (0, 15, 16)  # its class split since: held again
    assert cl.held(a, busy, free) == (0, 15, 16)  # the memo
    assert cl.classes() == [(4, 5, 6, 7, 8, 9), (10, 13), (11, 12)]
    free[16] = 3.0
    cl.spread(free)
    assert free == [0.0] * 4 + [0.0] * 6 + [2.0, 3.0, 3.0, 2.0]
    ordered = [Task("coll", "a", 1.0, a, ()), Task("xfer", "b", 1.0, b, ()), Task("fwd", "c", 1.0, (1,), ())]
    assert classes_of(ordered, 4, 10) == [(4, 5, 6, 7, 8, 9), (10, 13), (11, 12)]


@functools.cache
def _gpt_tiny():
    model, inputs = zoo.build("gpt_tiny")
    return trace(model, inputs)


@pytest.mark.parametrize(("cluster", "devices"), [("dgx-h100", 16), ("commodity", 16)])
def test_simulations_are_the_same_with_links_merged(cluster, devices):
    """Data parallelism (collectives over every device) and Megatron's layout (over
    each node) on a cluster of 64 links: the timeline and figures of the simulation
    with links merged are those of one with each link scheduled."""
    g = _gpt_tiny()
    cl = Cluster.preset(cluster, devices)
    assert len(cl.links) >= tasks.MERGE_LINKS_FROM
    space = Space(g, devices)
    for dec in (recipes.data_parallel(space), recipes.megatron(space, 4)):
        sims = []
        for merge in (True, False):
            with merging(merge):
                sims.append(Simulator(g, cl).simulate(space.expand(dec)))
        a, b = sims
        assert a.timeline == b.timeline and a.iteration_time_s == b.iteration_time_s
        assert a.memory_bytes == b.memory_bytes and a.critical_path_s == b.critical_path_s
        if dec == recipes.data_parallel(space):  # each all-reduce loads every link: all of them merged into one
            ordered = [s.task for s in a.timeline if s.task.kind != "update"]
            loaded = {r for t in ordered for r in t.resources if r >= devices}
            assert len(loaded) > 1 and loaded in map(set, classes_of(ordered, devices, len(cl.links)))
