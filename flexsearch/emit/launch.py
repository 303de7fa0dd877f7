"""Run a function on ``world`` local processes joined by a gloo process group.

For tests and benchmarks of emitted plans on one machine (``torchrun`` does the same
for real jobs): ``run_ranks(fn, world, *args)`` spawns the processes, gives each a
process group with a timeout (a failing rank fails the job instead of hanging it),
and returns every rank's result, or raises :class:`RanksFailed` with the first rank's
error. A job that runs past its timeout reports where each rank that was still running
stood (Python stacks written by :mod:`faulthandler` shortly before the deadline), so a
hang in CI names its cause.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class RanksFailed(RuntimeError):
    """A rank raised, died, or the job ran past its timeout."""


def _entry(fn: Callable, rank: int, world: int, store_path: str, out: str, threads: int,
           pg_timeout_s: float, stack_after_s: float, args: tuple) -> None:
    torch.set_num_threads(threads)
    stacks = open(os.path.join(out, f"{rank}.stack"), "w")  # noqa: SIM115 - open until the process ends
    faulthandler.dump_traceback_later(stack_after_s, file=stacks)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        store = dist.FileStore(store_path, world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))
        try:
            result = fn(rank, world, *args)
        finally:
            dist.destroy_process_group()
        torch.save(result, os.path.join(out, f"{rank}.pt"))
    except BaseException:  # noqa: BLE001 - reported to the parent
        with open(os.path.join(out, f"{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise SystemExit(1) from None


def run_ranks(fn: Callable, world: int, *args: Any, timeout_s: float = 300, threads: int = 1,
              pg_timeout_s: float = 60) -> list[Any]:
    """``[fn(rank, world, *args) for rank in range(world)]``, each in its own process."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="flexsearch-ranks-") as d:
        store = os.path.join(d, "store")
        stack_after_s = max(1.0, timeout_s - min(10.0, timeout_s / 10))
        procs = [ctx.Process(target=_entry, args=(fn, r, world, store, d, threads, pg_timeout_s, stack_after_s,
                                                  args), daemon=True) for r in range(world)]
        for p in procs:
            p.start()
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
        for p in procs:
            p.join(max(0.0, (deadline - datetime.datetime.now()).total_seconds()))
        alive = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        errors = []
        for r in range(world):
            path = os.path.join(d, f"{r}.err")
            if os.path.exists(path):
                errors.append(f"rank {r}:\n" + open(path).read())
        if errors:
            raise RanksFailed("\n".join(errors))
        if alive:
            stacks = "".join(f"\nrank {r} stood at:\n{_read(os.path.join(d, f'{r}.stack'))}" for r in alive)
            raise RanksFailed(f"ranks {alive} still running after {timeout_s:.0f} s (killed){stacks}")
        bad = [r for r, p in enumerate(procs) if p.exitcode != 0]
        if bad:
            raise RanksFailed(f"ranks {bad} exited with codes {[procs[r].exitcode for r in bad]}")
        return [torch.load(os.path.join(d, f"{r}.pt"), weights_only=False) for r in range(world)]


def _read(path: str) -> str:
    return open(path).read() if os.path.exists(path) else "(no stack written)\n"
