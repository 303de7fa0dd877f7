"""Timing one op call on this device, as the profiler (:mod:`flexsearch.cost.profiler`)
and the calibration's probes measure ops: forward, then ``torch.autograd.grad`` of its
outputs, each the median of repeats after warm-up (:func:`measure_call`), on operands
out of the cache (:func:`operand_copies`), on a GPU with CUDA events and the GPU kept
busy while the CPU enqueues the call (:class:`_Timer`)."""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from flexsearch.graph.calls import ArgTensor, OpCall


def _materialize(spec: Any, device: torch.device, leaves: list[torch.Tensor], input_grads: bool = True) -> Any:
    if not isinstance(spec, ArgTensor):
        return spec
    if spec.dtype.is_floating_point:
        grad = input_grads and spec.grad  # as the model: a gradient for those computed from parameters
        leaf = torch.randn(spec.shape, dtype=spec.dtype, device=device).requires_grad_(grad)
        if grad:
            leaves.append(leaf)
        return leaf
    if spec.dtype == torch.bool:
        return torch.zeros(spec.shape, dtype=torch.bool, device=device)
    return torch.zeros(spec.shape, dtype=spec.dtype, device=device)


def call_bytes(call: OpCall) -> int:
    """Bytes of an op call's tensor arguments and module state."""
    total = 0
    for x in tree_flatten((call.args, call.kwargs))[0]:
        if isinstance(x, ArgTensor):
            total += math.prod(x.shape) * x.dtype.itemsize
    for _, shape, dtype, _ in call.module_state:
        total += math.prod(shape) * dtype.itemsize
    return total


@functools.cache
def cache_bytes(device: torch.device) -> int:
    """The device's last-level cache in bytes: a CUDA device's L2, else the largest CPU
    cache level Linux lists (``/sys/devices/system/cpu/cpu0/cache``); 64 MiB when
    neither says."""
    if device.type == "cuda":
        return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)) or 64 << 20
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip().upper()
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        try:
            sizes.append(int(text.rstrip("KMG")) * scale)
        except ValueError:
            continue
    return max(sizes, default=64 << 20)


class _Timer:
    """Seconds of one call: on a CPU its wall time; on a GPU the time between two CUDA
    events around it, with the GPU kept busy (``torch.cuda._sleep``, :data:`HEAD_START_S`)
    while the CPU enqueues the call's kernels, so that the events time the kernels and
    not the Python and launch work before each: in training the CPU runs ahead of the
    GPU and hides it (timed without the head start, GPT-2's ops on an H200 came out 6-57%
    slower than inside the model's step). A call whose enqueueing outlasts the head start
    doubles it for the calls after it."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.head_s = HEAD_START_S
        self.hz = 0.0
        if self.cuda:
            self.hz = (getattr(torch.cuda.get_device_properties(device), "clock_rate", 0) or 2_000_000) * 1e3

    def time(self, fn: Callable[[], Any]) -> tuple[float, Any]:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(int(self.head_s * self.hz))
            start.record()
            t0 = time.perf_counter()
            out = fn()
            if time.perf_counter() - t0 > self.head_s:  # the GPU caught up with the CPU: spin longer
                self.head_s *= 2
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1e3, out
        t0 = time.perf_counter()
        out = fn()
        return time.perf_counter() - t0, out


MAX_COPIES = 16
HEAD_START_S = 0.005
"""On a GPU, how long the GPU spins before each timed call while the CPU enqueues it
(:class:`_Timer`)."""


def operand_copies(call: OpCall, device: torch.device, out_bytes: int = 0) -> int:
    """How many copies of an op's operands (and ``out_bytes`` of outputs each)
    :func:`measure_call` cycles through so that each call finds its own out of the
    cache: enough for twice the device's last-level cache (:func:`cache_bytes`), at most
    :data:`MAX_COPIES`; 1 for an op already that large."""
    return max(1, min(MAX_COPIES, math.ceil(2 * cache_bytes(device) / max(1, call_bytes(call) + out_bytes))))


def measure_call(call: OpCall, *, device: torch.device | str = "cpu", warmup: int = 2, repeats: int = 5,
                 input_grads: bool = True, autocast: str | None = None, cold: bool = True) -> tuple[float, float]:
    """Median forward and backward seconds of one op call on real tensors (the
    backward w.r.t. the float inputs and the parameters; the parameters only when not
    ``input_grads``). ``autocast``: the forward runs under ``torch.autocast`` of that
    dtype (mixed precision: its casts included, a weight's once per call as once per
    training step), the backward outside it, as in training.

    ``cold`` (default): as inside a training step, where an op's weights and saved
    activations were last touched long before it runs, each call reads operands that
    are not in the cache: the op's inputs and parameters exist in
    :func:`operand_copies` copies, used in turn (a forward's inputs are copied just
    before it, as its producer would have written them); the backwards run in the
    order of their forwards, each after every forward of its round (as many copies as
    the inputs and outputs leave out of the cache). Timed hot, in a loop over
    the same tensors, GPT-tiny's microbatch Linears ran 7-23% faster than the same ops
    inside the model's step (``torch.profiler``), and evicting the whole cache before
    each call slowed small ops several times over (it evicts the interpreter's and the
    dispatcher's data too, which a training step keeps warm)."""
    device = torch.device(device)
    timer = _Timer(device)
    copies = operand_copies(call, device) if cold else 1

    def materialize() -> tuple[tuple, dict, dict[str, torch.Tensor], list[torch.Tensor]]:
        leaves: list[torch.Tensor] = []
        args, kwargs = tree_map(lambda s: _materialize(s, device, leaves, input_grads), (call.args, call.kwargs))
        state: dict[str, torch.Tensor] = {}
        for local, shape, dtype, grad in call.module_state:
            if dtype.is_floating_point:
                t = torch.randn(shape, dtype=dtype, device=device).requires_grad_(grad)
                if grad:
                    leaves.append(t)
            else:
                t = torch.zeros(shape, dtype=dtype, device=device)
            state[local] = t
        return args, kwargs, state, leaves

    sets = [materialize() for _ in range(copies)]

    def fresh(j: int) -> tuple[tuple, dict]:
        """Non-leaf copies of copy ``j``'s float inputs (in-place ops such as
        ReLU(inplace=True) cannot write to a leaf), made outside the timed region."""
        args, kwargs = sets[j][:2]
        return tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) and x.requires_grad else x, (args, kwargs))

    def plain(j: int, a: tuple, k: dict) -> Any:
        if call.op == "call_module":
            return torch.func.functional_call(call.module, sets[j][2], a, k, strict=False)
        if call.op == "call_method":
            return getattr(a[0], call.target)(*a[1:], **k)
        return call.target(*a, **k)

    def run(j: int, a: tuple, k: dict) -> Any:
        if autocast is None:
            return plain(j, a, k)
        with torch.autocast(device.type, dtype=getattr(torch, autocast)):
            return plain(j, a, k)

    for i in range(warmup):
        run(i % copies, *fresh(i % copies))
    fwd_times = []
    for i in range(repeats):
        j = (warmup + i) % copies
        a, k = fresh(j)
        fwd_times.append(timer.time(lambda j=j, a=a, k=k: run(j, a, k))[0])
    fwd = statistics.median(fwd_times)

    def grads_of(out: Any) -> list[torch.Tensor]:
        return [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.grad_fn is not None]

    # The backward keeps every graph of a round alive: as many copies as their inputs and
    # outputs together leave out of the cache (an op that writes far more than it reads
    # would hold many copies' worth of saved tensors otherwise).
    out_bytes = sum(t.numel() * t.element_size() for t in grads_of(run(0, *fresh(0))))
    round_size = min(copies, operand_copies(call, device, out_bytes))
    bwd_times: list[float] = []
    while len(bwd_times) < warmup + repeats:  # whole rounds: at least ``repeats`` timed samples
        outs = [grads_of(run(j, *fresh(j))) for j in range(round_size)]
        if not outs[0] or not sets[0][3]:
            break
        for j in range(round_size):
            ones = [torch.ones_like(t) for t in outs[j]]
            seconds, _ = timer.time(lambda o=outs[j], g=ones, w=sets[j][3]: torch.autograd.grad(o, w, g, allow_unused=True))
            bwd_times.append(seconds)
        del outs
    return fwd, statistics.median(bwd_times[warmup:]) if bwd_times else 0.0
