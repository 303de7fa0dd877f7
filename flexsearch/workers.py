"""How flexsearch uses this machine's cores: independent work in a forked process (the
tracer's second pass beside its first, :func:`flexsearch.graph.tracer.trace_calls`; the
planner hands independent search phases, the pipeline search and the ILP, to one worker
while it runs the baselines). Every piece is deterministic, so a graph or a plan does
not depend on how many processes made it. Python's cyclic garbage collector stays as
the caller set it (:func:`flexsearch.collector.cycles_paused`)."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor


def pool() -> ProcessPoolExecutor:
    """One forked worker (it inherits the loaded modules; nothing is imported again),
    computing on one thread (:func:`_one_thread`)."""
    return ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork"), initializer=_one_thread)


def _one_thread() -> None:
    """A forked worker's torch runs on one thread: the parent's OpenMP threads do not
    fork with it, and a parallel region on more than one (the tracer's real run of a
    fused RNN kernel, :func:`flexsearch.graph.saved.fused_rnn_saves`, after the parent
    ran one) waits for them forever. PyTorch's DataLoader workers do the same."""
    import torch

    torch.set_num_threads(1)


def submit(pool: ProcessPoolExecutor, fn: Callable, *args) -> Future:
    """``pool.submit(fn, *args)`` with the call pickled here and now: the pool pickles in
    a thread of its own, while this one goes on filling the cost context's caches."""
    return pool.submit(_call_pickled, pickle.dumps((fn, args)))


def _call_pickled(payload: bytes):
    fn, args = pickle.loads(payload)
    return fn(*args)


def worker_count(workers: int | None) -> int:
    """Processes a trace or a search may use: ``workers``, else the CPUs this process may run on;
    1 where processes cannot be forked."""
    if "fork" not in multiprocessing.get_all_start_methods():
        return 1
    if workers is not None:
        return max(1, workers)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


_FLAG = None
"""The flag of :func:`new_flag` (a fork context's ``Event``), inherited by the workers
forked after it was made."""


def new_flag():
    """A flag this process raises (``.set()``) and a worker forked after this call reads
    with :func:`flag_raised` (an ``Event`` is shared by inheritance, not by pickling: the
    function that reads it is what a submitted call carries)."""
    global _FLAG
    _FLAG = multiprocessing.get_context("fork").Event()
    return _FLAG


def flag_raised() -> bool:
    """Has the process that made the last :func:`new_flag` (this one, or the one this
    worker was forked from) raised it?"""
    return _FLAG is not None and _FLAG.is_set()


_INHERITED: Callable | None = None
"""The function a :class:`Helper` process runs, set before it forks."""


def _call_inherited(args: tuple):
    assert _INHERITED is not None
    return _INHERITED(*args)


class Helper:
    """A second process for a phase that has a batch of independent calls of one
    function, closures included: it forks at the first batch of two or more, inheriting
    ``fn`` and everything ``fn`` holds then (only arguments and results are pickled).
    :meth:`map` runs every other call there and the rest here, and returns the results in
    order, as ``[fn(*a) for a in jobs]`` would: ``fn`` must be deterministic and its
    result must not depend on what earlier calls cached. ``enabled=False``, or in a
    daemonic process (a rank of :func:`flexsearch.emit.launch.run_ranks`, which may have
    no children): every call here. :meth:`close` (or the helper's end) stops the
    process."""

    def __init__(self, fn: Callable, enabled: bool = True) -> None:
        self.fn = fn
        self.enabled = (enabled and "fork" in multiprocessing.get_all_start_methods()
                        and not multiprocessing.current_process().daemon)
        self._pool: ProcessPoolExecutor | None = None

    def map(self, jobs: list[tuple]) -> list:
        if not self.enabled or len(jobs) < 2:
            return [self.fn(*a) for a in jobs]
        if self._pool is None:
            global _INHERITED
            _INHERITED = self.fn
            self._pool = pool()
            # shut down with this helper when a phase leaves by an exception, without close()
            weakref.finalize(self, self._pool.shutdown, wait=False, cancel_futures=True)
        there = [self._pool.submit(_call_inherited, a) for a in jobs[1::2]]
        here = [self.fn(*a) for a in jobs[::2]]
        return [here[i // 2] if i % 2 == 0 else there[i // 2].result() for i in range(len(jobs))]

    def span(self, costs: Sequence[float]) -> float:
        """How long :meth:`map` takes over jobs of these ``costs`` (in any unit of time),
        its two processes side by side: the larger of their shares, the sum where it
        runs every call here."""
        if not self.enabled or len(costs) < 2:
            return float(sum(costs))
        return float(max(sum(costs[::2]), sum(costs[1::2])))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
            self._pool = None
