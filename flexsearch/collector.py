"""Python's cyclic garbage collector paused around work that allocates millions of
objects and makes few reference cycles: a search (:func:`flexsearch.search.planner.plan_graph`)
and a trace (:func:`flexsearch.graph.tracer.trace_calls`)."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def cycles_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused for the block or, as a decorator, the
    call (restored after; a worker forked inside inherits the pause). A search allocates millions of small objects
    (tasks, keys, fragments) that reference counting frees, for they make no reference
    cycles (``gc.collect()`` after 300 delta and 50 full simulations, the baselines and
    200 MCMC steps of GPT-2 small on 8 devices found none; a whole plan leaves the ILP's
    model, a few hundred objects however long it searches, freed once the collector
    runs again), yet every few hundred
    allocations start a collection, and the older generations' rescan the traced graph
    and the caches. Paused, GPT-2 small's full simulations on 8 devices ran 1.5-2.1x
    as many per second and its delta simulations 1.2-1.4x (``benchmarks/
    search_speed.py``: ``paused_full_speedup=``, ``paused_delta_speedup=``). A trace
    makes some cycles (the fake-tensor mode, the FX graph), freed once the collector runs
    again: paused, Megatron's GPT 1T (2,825 ops, on meta) traced in 4.5-5.4 s against
    5.4-7.0 s (four runs each, alternated), its peak memory 26 MB higher (528 MB)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
