"""The calibration's probes: models that are not in any benchmark, and the measurements
taken on them (on every rank at once, or in this process).

- :class:`Chain`: ``layers`` x (Linear 16 -> 16, ReLU) in a ModuleList: framework
  overhead per op with no compute to speak of; each pair is its own FSDP unit. The
  probes ``deep8`` and ``deep32`` differ only in depth, so the slope of a residual over
  the op count is a per-op cost and its intercept a per-step cost.
- :func:`probe_job` (on every rank): collectives at sizes 64 B .. 16 MiB, the overlap
  of an all-reduce with compute, the op mix, optimizer updates, Adam over DTensors.
- :func:`op_mix_times`, :func:`measure_updates`, :func:`measure_working_tensors` (in
  one process).
"""

from __future__ import annotations

import gc
import statistics
import time

import torch

from flexsearch.measure import median_time, reset_peak, status_bytes

COLLECTIVE_SIZES = tuple(4 ** k * 64 for k in range(10))  # 64 B .. 16 MiB
UPDATE_SETS = ((1, 1 << 22), (8, 1 << 19), (64, 1 << 16), (512, 1 << 13), (2, 1 << 17), (32, 1 << 13),
               (256, 1 << 10))
"""(tensors, elements each) of the optimizer-update measurements: bytes and tensor
counts varied independently, so the fit separates the two terms."""
PROBES = {"deep8": 8, "deep32": 32}
"""Probe model name -> its depth."""
OVERLAP_SAMPLES = 15
"""Timed samples of each of the overlap probe's three measurements (interleaved)."""
CONCURRENCY_SAMPLES = 5
"""Measurements of the op mix alone and on every rank at once (interleaved)."""


class Chain(torch.nn.Module):
    """``layers`` x (Linear 16 -> 16, ReLU) in a ModuleList (module docstring)."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU()) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def build_probe(name: str):
    """``(model, inputs, target)`` of a probe (batch 16), the same in every process."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model, x = Chain(PROBES[name]), (torch.randn(16, 16),)
        with torch.no_grad():
            y = torch.randn(model(*x).shape)
    return model, x, y


def optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-4)
    return torch.optim.SGD(params, lr=1e-4, momentum=0.9 if name == "momentum" else 0.0)


def measure_updates(threads: int) -> dict[str, list[tuple[int, int, float]]]:
    """Per optimizer ``(tensors, bytes, seconds)`` of updates of the parameter sets of
    :data:`UPDATE_SETS`, on plain CPU tensors."""
    torch.set_num_threads(threads)
    out = {}
    for name in ("adam", "momentum", "sgd"):
        out[name] = []
        for n, numel in UPDATE_SETS:
            ps = [torch.nn.Parameter(torch.randn(numel)) for _ in range(n)]
            for q in ps:
                q.grad = torch.randn(numel)
            opt = optimizer(name, ps)
            out[name].append((n, n * numel * 4, median_time(opt.step)))
    return out


def measure_working_tensors(threads: int) -> float:
    """Peak resident growth of an Adam update over its gradients, in multiples of the
    largest parameter tensor (glibc pinned so every tensor is its own mapping)."""
    import ctypes

    torch.set_num_threads(threads)
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD
    libc.mallopt(-1, 1 << 16)  # M_TRIM_THRESHOLD
    numel = 1 << 22
    ps = [torch.nn.Parameter(torch.randn(numel)) for _ in range(4)]
    for q in ps:
        q.grad = torch.randn(numel)
    opt = optimizer("adam", ps)
    opt.step()
    values = []
    for _ in range(5):
        gc.collect()
        libc.malloc_trim(0)
        base = status_bytes("VmRSS")
        reset_peak()
        opt.step()
        values.append((status_bytes("VmHWM") - base) / (numel * 4))
    return statistics.median(values)


def op_mix_times(threads: int) -> tuple[float, float]:
    """Summed median forward and backward seconds of a fixed mix of ops (a Linear, a
    convolution, an LSTM, a LayerNorm, a GELU; none of the benchmarks' models), each
    measured alone as the profiler does."""
    from flexsearch.cost.op_timing import measure_call
    from flexsearch.graph.tracer import trace_calls

    torch.set_num_threads(threads)
    mods = (
        (torch.nn.Linear(512, 2048), torch.randn(256, 512)),
        (torch.nn.Conv2d(16, 32, 3, padding=1), torch.randn(32, 16, 32, 32)),
        (torch.nn.LSTM(128, 128, batch_first=True), torch.randn(32, 16, 128)),
        (torch.nn.LayerNorm(1024), torch.randn(256, 1024)),
        (torch.nn.GELU(), torch.randn(1024, 1024)),
    )
    fwd = bwd = 0.0
    for mod, x in mods:
        graph, calls = trace_calls(torch.nn.Sequential(mod), (x,))
        for node in graph.nodes:
            if node.name in calls:
                f, b = measure_call(calls[node.name], repeats=9, warmup=3)
                fwd, bwd = fwd + f, bwd + b
    return fwd, bwd


def local_step(name: str, steps: int, warmup: int) -> dict[str, float]:
    """A probe trained in this process alone: median seconds of a step and of a no-grad
    forward."""
    from flexsearch.measure import mse

    model, x, y = build_probe(name)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)

    def step():
        opt.zero_grad()
        mse(model(*x), y).backward()
        opt.step()

    def forward():
        with torch.no_grad():
            model(*x)

    return {"step": median_time(step, steps, warmup), "forward": median_time(forward, steps, warmup)}


def probe_job(rank: int, world: int, what: str, n: int) -> dict:
    """On every rank: one calibration measurement (module docstring)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    if what == "overlap":  # does a collective overlap with compute on this rank's core?
        buf = torch.randn(n)
        a, b = torch.randn(512, 512), torch.randn(512, 512)

        def compute():
            for _ in range(20):
                a @ b

        def both():
            w = dist.all_reduce(buf, async_op=True)
            compute()
            w.wait()

        fns = {"compute": compute, "comm": lambda: dist.all_reduce(buf), "both": both}
        times: dict[str, list[float]] = {key: [] for key in fns}
        for i in range(OVERLAP_SAMPLES + 2):  # interleaved, so that a drift of the machine hits all three alike
            for key, fn in fns.items():
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                if i >= 2:
                    times[key].append(time.perf_counter() - t0)
        return {key: statistics.median(ts) for key, ts in times.items()}
    if what == "collectives":  # t(M) of each collective the emitters use
        out = {}
        for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast"):
            rows = []
            for size in COLLECTIVE_SIZES:
                full = torch.randn(size // 4)
                shard = torch.randn(size // 4 // world)
                fn = {"all_reduce": lambda f=full: dist.all_reduce(f),
                      "all_gather": lambda f=full, s=shard: dist.all_gather_single(f, s),
                      "reduce_scatter": lambda f=full, s=shard: dist.reduce_scatter_single(s, f),
                      "broadcast": lambda f=full: dist.broadcast(f, 0)}[op]
                dist.barrier()
                rows.append((size, median_time(fn, 7 if size > 1 << 22 else 15, 2)))
            out[op] = rows
        return out
    if what == "ops":  # the op mix alone on rank 0 (the others wait at a barrier, idle) and on every rank at once
        alone: list[tuple[float, float]] = []
        together: list[tuple[float, float]] = []
        for _ in range(CONCURRENCY_SAMPLES):  # interleaved, so that a drift of the machine hits both alike
            dist.barrier()
            if rank == 0:
                alone.append(op_mix_times(torch.get_num_threads()))
            dist.barrier()
            together.append(op_mix_times(torch.get_num_threads()))
        f, b = (statistics.median(x[i] for x in together) for i in (0, 1))
        return {"forward": f, "backward": b,
                "alone": tuple(statistics.median(x[i] for x in alone) for i in (0, 1)) if alone else None}
    if what == "updates":  # every rank at once, as in training
        dist.barrier()
        return measure_updates(torch.get_num_threads())
    if what == "sharded_update":  # Adam over DTensor parameters vs plain ones
        mesh = init_device_mesh("cpu", (world,))
        out = {}
        for key in ("plain", "dtensor"):
            ps = []
            for _ in range(n):
                t = torch.randn(1024)
                if key == "dtensor":
                    t = distribute_tensor(t, mesh, [Replicate()])
                q = torch.nn.Parameter(t)
                q.grad = torch.ones_like(q)
                ps.append(q)
            opt = optimizer("adam", ps)
            dist.barrier()
            out[key] = median_time(opt.step)
        return out
    raise ValueError(what)
