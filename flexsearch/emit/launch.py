"""Run a function on ``world`` local processes joined by a gloo process group.

For tests and benchmarks of emitted plans on one machine (``torchrun`` does the same
for real jobs): ``run_ranks(fn, world, *args)`` starts the processes, gives each a
process group with a timeout (a failing rank fails the job instead of hanging it),
and returns every rank's result, or raises :class:`RanksFailed` with every failed rank's
error (its traceback; :attr:`RanksFailed.cause`: the root cause in a line or two) and the
results of the ranks that finished. A job that runs past its timeout reports where each
rank that was still running stood (at the deadline the parent asks each running rank
for its Python stacks, which :mod:`faulthandler` writes on ``SIGUSR1``, then kills it),
so a hang in CI names its cause.

On Linux the ranks are forked from :mod:`multiprocessing`'s fork server, which imports
torch and flexsearch once (:data:`PRELOAD`), not spawned: a rank then starts in about
50 ms instead of the ~2 s a fresh interpreter spends importing them (a 2-rank job:
0.05 s against 2.0 s on CI's 2 cores). The server starts with the launching process's
``sys.path`` (so it imports the flexsearch that process runs). Each rank gets the
launching process's environment as it is at the launch; variables libraries read when
imported (:data:`IMPORT_TIME`) are the server's, so a launch where they changed since
the server started spawns its ranks, as does one where the server cannot start.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import os
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PRELOAD = ("torch", "torch.distributed", "flexsearch.emit", "flexsearch.emit.verify", "flexsearch.emit.data",
           "flexsearch.emit.sharded", "flexsearch.emit.staged", "flexsearch.emit.decentralized",
           "flexsearch.graph.tracer", "torch.distributed.fsdp", "torch.distributed.pipelining",
           "torch.distributed.optim", "torch.export._trace")
"""What the fork server imports before forking ranks; ``transformers`` too where the
launching process has imported it when the server starts. Every runtime the emitter
has (DDP, FSDP2, DTensor, pipelining, ZeRO-1's optimizer, D-PSGD), the verifier and
the tracer (``torch.fx``'s first symbolic trace imports ``torch.export._trace``, and
with it AOTAutograd and networkx): a rank imports them lazily otherwise, about 2 s on
each rank of every job here (the pipelining package alone 0.9 s), where the server
imports them once. The server skips a module that does not import."""

IMPORT_TIME = ("TORCH_", "PYTORCH_", "OMP_", "KMP_", "MKL_", "OPENBLAS_", "CUDA_", "NCCL_", "HF_", "TRANSFORMERS_")
"""Prefixes of the environment variables libraries read when they are imported."""

_server_env: dict[str, str] | None = None  # IMPORT_TIME variables as the fork server started with them

PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
"""How gloo says a peer went away: a rank that failed with one of these failed because
another rank stopped (:attr:`RanksFailed.cause` looks past it)."""


class RanksFailed(RuntimeError):
    """A rank raised, died, or the job ran past its timeout. ``str()``: every failed
    rank's traceback; ``causes``: rank -> its error in a line or two (:func:`describe`);
    ``results``: rank -> the result of each rank that finished."""

    def __init__(self, message: str, causes: dict[int, str] | None = None, results: dict[int, Any] | None = None):
        super().__init__(message)
        self.causes = causes or {}
        self.results = results or {}

    @property
    def cause(self) -> str:
        """Why the job failed, in a line or two: the first rank's error that is not a lost
        peer (:data:`PEER_LOST`, what the other ranks see when one stops), else the first
        rank's; without a rank's error (a timeout, a killed process), the message's first
        line."""
        if self.causes:
            ranks = sorted(self.causes)
            r = next((r for r in ranks if not any(p in self.causes[r] for p in PEER_LOST)), ranks[0])
            return f"rank {r}: {self.causes[r]}"
        lines = [ln for ln in str(self).splitlines() if ln.strip()]
        return lines[0] if lines else "the ranks failed"


def _line(exc: BaseException) -> str:
    """``module.Type: first line of the message (notes)``, builtins without a module."""
    t = type(exc)
    name = t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"
    text = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), "")
    notes = "; ".join(str(n) for n in getattr(exc, "__notes__", ()))
    return (f"{name}: {text}" if text else name) + (f" ({notes})" if notes else "")


def describe(exc: BaseException) -> str:
    """``exc`` in one line (type, message's first line, notes), and a second naming the
    exception it was raised from or while handling, the first of the chain (the original
    error), when there is one."""
    root, seen = exc, {id(exc)}
    while True:
        nxt = root.__cause__ if root.__cause__ is not None else (
            None if root.__suppress_context__ else root.__context__)
        if nxt is None or id(nxt) in seen:
            break
        root = nxt
        seen.add(id(nxt))
    return _line(exc) if root is exc else f"{_line(exc)}\ncaused by {_line(root)}"


def _context():
    """The fork server's context, :data:`PRELOAD` imported by the server when it starts
    (the first launch of this process; later calls leave a running server as it is);
    spawning off Linux (forking after macOS's frameworks load is unsafe) and where the
    :data:`IMPORT_TIME` variables differ from those the server started with."""
    global _server_env
    if sys.platform != "linux" or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    env = {k: v for k, v in os.environ.items() if k.startswith(IMPORT_TIME)}
    if _server_env is None:
        _server_env = env
    elif env != _server_env:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([*PRELOAD, *(m for m in ("transformers",) if m in sys.modules)])
    return ctx


@contextlib.contextmanager
def _server_path() -> Iterator[None]:
    """While the first launch starts the fork server: ``PYTHONPATH`` the launching
    process's ``sys.path`` (before Python 3.13 the server imports :data:`PRELOAD`
    without it, and an installed flexsearch would shadow a checkout on that path); the
    variable as it was after."""
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old


def _entry(fn: Callable, rank: int, world: int, store_path: str, out: str, threads: int,
           pg_timeout_s: float, env: dict[str, str], args: tuple) -> None:
    os.environ.clear()
    os.environ.update(env)  # the parent's now, not the fork server's
    torch.set_num_threads(threads)
    stacks = open(os.path.join(out, f"{rank}.stack"), "w")  # noqa: SIM115 - open until the process ends
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        store = dist.FileStore(store_path, world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))
        # every rank connected before any leaves: a job that returns at once (no collective)
        # could close its connections while a peer was still connecting to it
        dist.barrier()
        try:
            result = fn(rank, world, *args)
        finally:
            dist.destroy_process_group()
        torch.save(result, os.path.join(out, f"{rank}.tmp"))
        os.replace(os.path.join(out, f"{rank}.tmp"), os.path.join(out, f"{rank}.pt"))  # whole, or not there
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        with open(os.path.join(out, f"{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        with open(os.path.join(out, f"{rank}.why"), "w") as f:  # else the parent takes the traceback's last line
            f.write(describe(e))
        raise SystemExit(1) from None


def run_ranks(fn: Callable, world: int, *args: Any, timeout_s: float = 300, threads: int = 1,
              pg_timeout_s: float = 60) -> list[Any]:
    """``[fn(rank, world, *args) for rank in range(world)]``, each in its own process."""
    env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="flexsearch-ranks-") as d:
        store = os.path.join(d, "store")

        def processes(ctx) -> list:
            return [ctx.Process(target=_entry, args=(fn, r, world, store, d, threads, pg_timeout_s, env, args),
                                daemon=True) for r in range(world)]

        procs = processes(_context())
        try:
            with _server_path():
                procs[0].start()
        except (EOFError, OSError):  # the fork server died starting (a preloaded import crashed it): spawn
            procs = processes(mp.get_context("spawn"))
            procs[0].start()
        for p in procs[1:]:
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
        errors, causes = [], {}
        for r in range(world):
            path = os.path.join(d, f"{r}.err")
            if os.path.exists(path):
                tb = open(path).read()
                errors.append(f"rank {r}:\n" + tb)
                why = os.path.join(d, f"{r}.why")
                causes[r] = open(why).read().strip() if os.path.exists(why) else tb.strip().splitlines()[-1]
        if errors:
            done = {r: torch.load(os.path.join(d, f"{r}.pt"), weights_only=False) for r in range(world)
                    if os.path.exists(os.path.join(d, f"{r}.pt"))}
            raise RanksFailed("\n".join(errors), causes, done)
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
