"""Measure an emitted plan on this machine's gloo processes: iteration time and peak memory.

``flexsearch calibrate`` (:mod:`flexsearch.calibrate`) fits the simulator's calibration
to such measurements; ``benchmarks/fidelity.py`` compares predictions with them.

**Time.** The plan is emitted (:func:`flexsearch.emit.parallelize`) on ``ranks`` fresh
gloo processes of ``threads`` threads; a step is ``zero_grad(); train_step();
Adam.step()`` on the same global batch (MSE against a fixed random target); the
iteration time is the median of ``steps`` steps after warm-up, per rank, the slowest
rank's.

**Memory.** The rank's resident set: the kernel's peak RSS (``VmHWM``), reset through
``/proc/self/clear_refs`` once the module and its optimizer are built, over the
warm-up steps (which allocate everything a step keeps: gradients, Adam state, DDP's
rebuilt buckets, pipeline buffers, and the step's activations and temporaries). glibc
is pinned meanwhile (``mallopt``: mmap threshold 64 KB, no dynamic adjustment), so that
every tensor is its own mapping and a freed one leaves the resident set; it is unpinned
before the timed steps (pinned, every large allocation page-faults: about 25 % slower).
Measured peak per rank = ``VmHWM - RSS before the steps - growth of RssFile + the rank's
parameter bytes`` (resident before). ``RssFile`` counts file-backed pages: the code of
the libraries that the first backward, loss or optimizer step faults in (conv and LSTM
kernels, the checkpointing path: 4 to 10 MB here), code, not memory a device would hold
(file pages faulted in after the peak are subtracted too: a slight under-count).

A process's first use of a kernel leaves memory behind that no later step allocates
again: oneDNN's compiled kernels, primitive caches and scratchpads, autocast's and the
dispatcher's tables (in one process, a step of the tiny AlexNet after such a first use
peaked at 7.6 MB against 9.0 MB for the first steps; bf16-mixed 6.5 against 11.7 MB;
GPT in bf16-mixed 50.4 against 61.6 MB). That is the library's, once per process, as a
GPU's context is, not the step's: so a throwaway copy of the emitted module runs two
steps first (the same shapes, so the same kernels) and is freed before the RSS is
taken.

torch's CPU allocator keeps no statistics of its own (``torch.cuda.memory_stats`` has no
CPU counterpart); ``torch.profiler`` with ``profile_memory`` records its allocations
with a running total (``tests/test_memory_tracker.py`` checks pipelines with it), but
counted from before the module is built, that total keeps what building it leaves
allocated (the RNN's DDP module: 44 MB beyond its copy and buckets), and counted from
the steps' start it misses what the build allocated for the steps (DDP's buckets). The
resident set's blind spot is the other way: pages of a tensor never written are not
resident (oneDNN's LSTM workspace, 8.3 MB per layer of the RNN case, is mostly never
touched: one process's RNN step peaked at 46.4 MB resident and 59.7 MB allocated).

**Noise.** Other processes on a small machine distort every time. Before each run
:func:`quietest` waits (``max_wait_s``) until the CPUs are nearly idle; during the timed
steps it counts the CPU time other processes took (``foreign``: CPUs' worth, from
``/proc/stat`` minus the ranks' own) and reruns a disturbed measurement (``> 0.25``) up
to ``retries`` times, keeping the quietest.
"""

from __future__ import annotations

import gc
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from flexsearch.plan import Plan

NOISY = 0.25
"""CPUs' worth of other processes' work above which a measurement is retried."""


def mse(out, target):
    """The measurements' loss: mean squared error in float32."""
    return F.mse_loss(out.float(), target)


def median_time(fn: Callable[[], Any], repeats: int = 9, warmup: int = 2) -> float:
    """Median seconds of ``repeats`` calls of ``fn`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def status_bytes(field_name: str) -> int:
    """A ``/proc/self/status`` field in bytes (``VmRSS``, ``VmHWM``, ``RssFile``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field_name}")


def reset_peak() -> None:
    """Reset the peak RSS (``VmHWM``) to the current RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def pin_malloc(threshold: int) -> None:
    """Pin glibc's mmap and trim thresholds (no dynamic adjustment): at 64 KB every
    tensor is its own mapping, returned to the kernel when freed, so the resident set
    follows the live tensors."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, threshold)  # M_MMAP_THRESHOLD
    libc.mallopt(-1, 2 * threshold)  # M_TRIM_THRESHOLD
    if threshold <= 1 << 16:
        libc.malloc_trim(0)


def _cpu_seconds() -> tuple[float, float]:
    """(busy CPU seconds of the whole machine, of this process) since boot."""
    hz = os.sysconf("SC_CLK_TCK")
    cpu = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    busy = (sum(cpu) - cpu[3] - cpu[4]) / hz  # all but idle and iowait
    own = [int(v) for v in Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[11:13]]
    return busy, sum(own) / hz


def busy_cpus(window_s: float = 0.5) -> float:
    """CPUs' worth of work the whole machine did over the next ``window_s`` seconds."""
    b0, _ = _cpu_seconds()
    time.sleep(window_s)
    b1, _ = _cpu_seconds()
    return (b1 - b0) / window_s


def wait_quiet(max_wait_s: float, below: float = NOISY) -> float:
    """Wait (at most ``max_wait_s``) until other processes leave the CPUs nearly idle;
    the last load seen."""
    deadline = time.monotonic() + max_wait_s
    load = busy_cpus()
    while load > below and time.monotonic() < deadline:
        time.sleep(2.0)
        load = busy_cpus()
    return load


def quietest(run: Callable[[], tuple[Any, float]], retries: int, max_wait_s: float, noisy: float = NOISY):
    """``run()`` -> (result, foreign load); rerun (after waiting for a quiet machine)
    while the load of other processes during the run exceeded ``noisy``, at most
    ``retries`` times; the result of the quietest run."""
    best, error = None, None
    for _ in range(max(1, retries)):
        wait_quiet(max_wait_s)
        try:
            out = run()
        except RuntimeError as e:  # a rank failed (e.g. aborted): try again
            error = e
            continue
        if best is None or out[1] < best[1]:
            best = out
        if out[1] <= noisy:
            break
    if best is None:
        raise error  # type: ignore[misc]
    return best


def load_average() -> str:
    """``/proc/loadavg``'s three figures, for the record."""
    try:
        return "load average " + ", ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "load average unknown"


def _local_bytes(t: torch.Tensor) -> int:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.to_local()
    return t.numel() * t.element_size()


def measure_job(rank: int, world: int, build: Callable, build_args: tuple, plan: Plan, steps: int,
                warmup: int, forward: bool = False) -> dict[str, Any]:
    """On every rank: emit ``plan`` for ``build(*build_args)`` (``(model, inputs,
    target)``, the same on every rank); memory over ``warmup`` (at least 2) steps, then
    the seconds of ``steps`` more (module docstring); with ``forward`` (data and SOAP
    plans) the median seconds of a no-grad forward too."""
    import torch.distributed as dist

    from flexsearch.emit import make_optimizer, parallelize
    from flexsearch.emit.data import batch_shard

    def emitted():
        model, x, y = build(*build_args)
        module = parallelize(model, plan)
        opt = make_optimizer(module, torch.optim.Adam, lr=1e-4)

        def step():
            opt.zero_grad()
            loss = module.train_step(x, y, mse)
            opt.step()
            return loss

        return module, step, x

    pin_malloc(1 << 16)
    warm = emitted()[1]  # the process's first use of each kernel, on a throwaway copy (module docstring)
    for _ in range(2):
        warm()
    del warm
    gc.collect()
    module, step, x = emitted()
    param_bytes = sum(_local_bytes(p) for p in module.parameters())
    gc.collect()
    pin_malloc(1 << 16)
    dist.barrier()
    base, code = status_bytes("VmRSS"), status_bytes("RssFile")
    reset_peak()
    for _ in range(max(2, warmup)):
        step()
    peak = status_bytes("VmHWM") - (status_bytes("RssFile") - code)
    pin_malloc(32 << 20)  # glibc's own ceiling: the heap keeps freed tensors for reuse, as by default
    for _ in range(2):
        step()
    dist.barrier()
    busy0, own0 = _cpu_seconds()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - t0)
    out = {"times": times, "rss_base": base, "rss_peak": peak, "param_bytes": param_bytes, "loss": float(loss)}
    if forward and plan.kind in ("data", "soap"):
        xs = tuple(batch_shard(t, rank, world) for t in x) if plan.kind == "data" else x

        def fwd():
            with torch.no_grad():
                module(*xs)

        dist.barrier()
        out["forward_s"] = median_time(fwd, steps, 2)
    busy1, own1 = _cpu_seconds()
    out.update(busy_s=busy1 - busy0, own_s=own1 - own0, wall_s=sum(times))
    dist.barrier()  # no rank tears its process group down while another still uses it
    return out


@dataclass(frozen=True)
class Measurement:
    """One plan measured on ``len(step_s)`` ranks (module docstring)."""

    step_s: tuple[float, ...]
    """Median step time per rank."""
    peak_bytes: tuple[float, ...]
    """Peak memory per rank."""
    foreign: float
    """CPUs' worth of other processes' work during the timed steps (0: a quiet machine)."""
    forward_s: float | None = None
    """The slowest rank's median no-grad forward (``forward=True``, data and SOAP plans)."""

    @property
    def time_s(self) -> float:
        """The iteration time: the slowest rank's."""
        return max(self.step_s)

    @property
    def worst_rank(self) -> int:
        """The rank with the largest peak memory."""
        return max(range(len(self.peak_bytes)), key=lambda i: self.peak_bytes[i])


def measure_plan(build: Callable, build_args: tuple, plan: Plan, *, ranks: int, threads: int = 1, steps: int = 10,
                 warmup: int = 3, forward: bool = False, timeout_s: float = 600, retries: int = 3,
                 max_wait_s: float = 60.0) -> Measurement:
    """Run ``plan`` on ``ranks`` processes (the quietest of ``retries`` runs; module
    docstring). ``build`` is a module-level function (the ranks import it) returning
    ``(model, inputs, target)``. Raises :class:`~flexsearch.emit.launch.RanksFailed`."""
    from flexsearch.emit.launch import run_ranks

    def run():
        res = run_ranks(measure_job, ranks, build, build_args, plan, steps, warmup, forward, threads=threads,
                        timeout_s=timeout_s, pg_timeout_s=120)
        wall = max(r["wall_s"] for r in res)
        return res, max(0.0, (res[0]["busy_s"] - sum(r["own_s"] for r in res)) / wall)

    res, foreign = quietest(run, retries, max_wait_s)
    fwd = max(r["forward_s"] for r in res) if "forward_s" in res[0] else None
    return Measurement(step_s=tuple(statistics.median(r["times"]) for r in res),
                       peak_bytes=tuple(float(r["rss_peak"] - r["rss_base"] + r["param_bytes"]) for r in res),
                       foreign=foreign, forward_s=fwd)
