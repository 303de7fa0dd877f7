"""How a search uses this machine: search phases in a forked worker process (the planner
hands independent phases, the pipeline search and the ILP, to one worker while it runs
the baselines; every phase is deterministic, so the plan does not depend on how many
workers ran it), with Python's cyclic garbage collector paused
(:func:`flexsearch.collector.cycles_paused`)."""

from __future__ import annotations

import multiprocessing
import os
import pickle
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor


def pool() -> ProcessPoolExecutor:
    """One forked worker (it inherits the loaded modules; nothing is imported again)."""
    return ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork"))


def submit(pool: ProcessPoolExecutor, fn: Callable, *args) -> Future:
    """``pool.submit(fn, *args)`` with the call pickled here and now: the pool pickles in
    a thread of its own, while this one goes on filling the cost context's caches."""
    return pool.submit(_call_pickled, pickle.dumps((fn, args)))


def _call_pickled(payload: bytes):
    fn, args = pickle.loads(payload)
    return fn(*args)


def worker_count(workers: int | None) -> int:
    """Processes a search may use: ``workers``, else the CPUs this process may run on;
    1 where processes cannot be forked."""
    if "fork" not in multiprocessing.get_all_start_methods():
        return 1
    if workers is not None:
        return max(1, workers)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
