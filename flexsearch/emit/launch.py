"""Run a function on ``world`` local processes joined by a gloo process group.

For tests and benchmarks of emitted plans on one machine (``torchrun`` does the same
for real jobs): ``run_ranks(fn, world, *args)`` spawns the processes, gives each a
process group with a timeout (a failing rank fails the job instead of hanging it),
and returns every rank's result, or raises :class:`RanksFailed` with the first rank's
error. A job that runs past its timeout reports where each rank that was still running
stood (at the deadline the parent asks each running rank for its Python stacks, which
:mod:`faulthandler` writes on ``SIGUSR1``, then kills it), so a hang in CI names its
cause.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class RanksFailed(RuntimeError):
    """A rank raised, died, or the job ran past its timeout."""


def _entry(fn: Callable, rank: int, world: int, store_path: str, out: str, threads: int,
           pg_timeout_s: float, args: tuple) -> None:
    torch.set_num_threads(threads)
    stacks = open(os.path.join(out, f"{rank}.stack"), "w")  # noqa: SIM115 - open until the process ends
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        store = dist.FileStore(store_path, world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))
        try:
            result = fn(rank, world, *args)
        finally:
            dist.destroy_process_group()
        torch.save(result, os.path.join(out, f"{rank}.tmp"))
        os.replace(os.path.join(out, f"{rank}.tmp"), os.path.join(out, f"{rank}.pt"))  # whole, or not there
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
        procs = [ctx.Process(target=_entry, args=(fn, r, world, store, d, threads, pg_timeout_s, args), daemon=True)
                 for r in range(world)]
        for p in procs:
            p.start()
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
        for p in procs:
            p.join(max(0.0, (deadline - datetime.datetime.now()).total_seconds()))
        alive = [r for r, p in enumerate(procs) if p.is_alive()]
        for r in alive:  # where do they stand? (faulthandler writes the stacks on SIGUSR1)
            os.kill(procs[r].pid, signal.SIGUSR1)
        written = time.monotonic() + 5.0
        while alive and time.monotonic() < written and not all(
                os.path.getsize(os.path.join(d, f"{r}.stack")) for r in alive if os.path.exists(
                    os.path.join(d, f"{r}.stack"))):
            time.sleep(0.05)
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
        # A rank that wrote its whole result and then died at exit (gloo's threads torn down:
        # "terminate called without an active exception", SIGABRT) finished its work.
        bad = [r for r, p in enumerate(procs) if p.exitcode != 0 and not os.path.exists(os.path.join(d, f"{r}.pt"))]
        if bad:
            raise RanksFailed(f"ranks {bad} exited with codes {[procs[r].exitcode for r in bad]}")
        return [torch.load(os.path.join(d, f"{r}.pt"), weights_only=False) for r in range(world)]


def _read(path: str) -> str:
    return open(path).read() if os.path.exists(path) else "(no stack written)\n"
