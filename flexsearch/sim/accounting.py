"""Per-device memory and the optimizer update: written once, for every simulator.

The op-level (:mod:`.simulator`), pipeline (:mod:`.pipeline`) and gossip
(:mod:`.decentralized`) simulators each collect a device's terms into a
:class:`DeviceMemory` and call :func:`peak_bytes`; each costs a device's optimizer
update with :func:`update_s`. Training precision, sharding and recomputation change
these terms here, in one place.

**Memory** of one device, bytes. Terms: ``P`` parameters it holds (its shard), ``G``
their gradients, ``O`` optimizer state (``k P`` for Adam ``k = 2``, momentum 1, SGD 0),
``A`` activations kept for the backward pass (what autograd saves, as the tracer
measured it, stashed microbatches, inputs received from other devices), ``C`` under
activation checkpointing the activations the largest unit rebuilds in the backward
(one unit at a time), ``Y`` what the
loss holds over the model's output from its forward into the backward (one
output-sized fp32 tensor, and the fp32 copy of a lower-precision output:
:func:`flexsearch.sim.footprint.loss_held_bytes`), ``T`` the loss's working tensor
beside it (one output-sized fp32 tensor: :func:`~flexsearch.sim.footprint.loss_working_bytes`),
``W`` a backward's gradient buffers above the activations it still keeps
(:func:`flexsearch.sim.footprint.backward_working`: in a pipeline stage, other
microbatches' activations stay stashed meanwhile, and the model's outputs stay until
the backward is over), ``B`` buffers (FSDP's gathered
parameters, a gossip snapshot and receive buffers, PipeDream's extra weight versions, a
parameter server's accumulation buffer), ``L`` the largest parameter tensor it holds::

    P + O + B + R + max(A + Y + max(T, C + W), G + U, H + Y + max(T, C + W)) + D

The loss's hold lasts into the backward's first gradients: torch's CPU ``mse_loss``
returns its loss as a view of its elementwise buffer (alive as long as the loss), the
cross-entropy keeps its log-softmax until its backward has made the gradient of the
output, and the step's caller still references the output. Its working tensor comes
on top in the loss's forward (the MSE's second elementwise buffer, the cross-entropy's
fp32 copy of bf16 logits beside its log-softmax) or in its backward (the gradient of
the output, computed in fp32 before the cast to the output's dtype), where ``W``
already counts a gradient of the output: hence ``max(T, W)``. A checkpointed unit
rebuilds its activations when the backward reaches it, after the loss's working tensor
is gone: ``C + W`` beside ``T``, with ``W`` over the rebuilt activations as they are
freed (:func:`flexsearch.sim.footprint.backward_working`). Until then the peak took
``A + C + Y + max(T, W)``, ``W`` over the kept activations alone: 37% over torch's
allocator for the tiny AlexNet (one unit) at batch 128 in fp32, 14% over for the tiny
GPT in bf16-mixed, both with full checkpointing (``tests/test_memory_tracker.py``). Measured on an H100 by
phase (``benchmarks/gpu_step.py``: the allocator's peak in the loss and in the
backward of one step, a cross-entropy over a zoo GPT's logits): ``P + O + A + Y``
within 2% of the loss's peak and ``P + O + A + Y + max(T, W)`` within 2.2% of the
backward's on every bf16-mixed row (TF32: -13%, the cross-entropy's two fp32 gradients
beside its log-softmax, which an fp32 output's ``T`` and ``W`` count once). Until then
the peak took ``A + max(Y, W)``: 2-19% under torch's CPU allocator on the loss rank
of every pipeline schedule and 21-32% under on Megatron's layout
(``tests/test_memory_tracker.py``), 10-26% under an H100's on GPT-2 small and medium.

Gradients are allocated as the backward frees the activations (``zero_grad`` frees
them), so they share the peak with the activations rather than adding to it, together
with the update's temporaries ``U``; ``D`` is DDP's gradient buckets (a flat copy of the
gradients, ``P``: ``gradient_as_bucket_view`` is off, torch's default, which the emitter
keeps). Calibrated (:mod:`flexsearch.cost.calibration`), ``U = w L`` (``w``,
``optimizer_working_tensors``, times the largest tensor: the update torch runs on this
host's CPU, one tensor at a time) and ``R`` is the runtime's own allocation for the
execution mode, both measured. Uncalibrated (the GPU presets), ``R = 0`` and ``U`` is
what ``torch.optim``'s multi-tensor update allocates on a GPU (:data:`UPDATE_WORKING`:
Adam's square roots of its second moments, one parameter-sized tensor per parameter).
Until this was one formula, the uncalibrated peak added ``G`` to the activations
(``P + G + O + A + max(Y, W) + B``, no buckets): measured on an H100
(``benchmarks/gpu_step.py``, one GPU, Adam), that was 13% over the allocator's peak for
GPT-2 XL and 24% over for a 1.1B Llama, by about ``G``. ``H`` is what a pipeline stage
holds once its first backward has run: the gradients made so far and the activations of
the microbatches still in flight (:func:`flexsearch.sim.pipeline_memory.held_with_gradients`;
0 outside pipelines). torch's allocator, traced by ``torch.profiler`` over a 1F1B
step of GPT-tiny on two stages, peaked at 37.8 MB on the first stage where ``max(A +
max(Y, W), G + w L)`` gave 30.9 MB: after the first backward the stage holds its
gradients and the next microbatch's activations at once.

**Update** of one device holding ``P`` bytes in ``n`` tensors: uncalibrated,
memory-bound passes moving ``UPDATE_TRAFFIC[optimizer] x P`` bytes at the device's
elementwise efficiency: the traffic of ``torch.optim``'s multi-tensor (``foreach``)
implementations, which the emitted module's optimizer runs on a GPU by default
(``torch/optim/adam.py: _multi_tensor_adam``, ``sgd.py: _multi_tensor_sgd``), one
read or write of a parameter-sized tensor per operand of each ``_foreach`` op. Adam:
``lerp_`` of the first moment (3), ``mul_`` and ``addcmul_`` of the second (2 + 3), its
``sqrt`` into a new tensor, ``div_`` and ``add_`` of eps (2 + 2 + 2), ``addcdiv_`` into
the parameter (4): 18 bytes per parameter byte (a fused kernel would move 7); momentum
``mul_``, ``add_``, ``add_`` (2 + 3 + 3): 8; SGD 3. Measured on an H200 (GPT-2 XL,
``benchmarks/gpu_step.py``), Adam's kernels took 29.7 ms against 11.4 ms at one pass of
7; calibrated,
``per_tensor x n + per_byte x P`` (more per tensor when the parameters are DTensors)
plus the execution mode's fixed cost per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from flexsearch.cost.calibration import DeviceCalibration, Mode
from flexsearch.cost.compute import Work, roofline_time

if TYPE_CHECKING:
    from flexsearch.sim.context import CostContext

OPTIMIZER_STATE = {"adam": 2, "momentum": 1, "sgd": 0}
"""Optimizer state per parameter, in parameter copies."""
UPDATE_TRAFFIC = {"adam": 18, "momentum": 8, "sgd": 3}
"""Bytes an update moves per parameter byte (module docstring)."""
UPDATE_WORKING = {"adam": 1, "momentum": 0, "sgd": 0}
"""Temporaries of an uncalibrated update, in copies of the parameters it updates:
``_multi_tensor_adam``'s ``_foreach_sqrt`` of the second moments makes a new tensor per
parameter; momentum and SGD update in place (no weight decay) (module docstring)."""


def param_copies(optimizer: str) -> float:
    """Bytes a replicated device holds per parameter byte, uncalibrated: the parameter,
    its gradient and the optimizer state (``P + G + O`` over ``P``), for partitioners
    that budget memory per layer before simulating."""
    return float(2 + OPTIMIZER_STATE[optimizer])


def check_optimizer(name: str) -> str:
    """``name`` when it is an optimizer the accounting knows, else ValueError."""
    if name not in OPTIMIZER_STATE:
        raise ValueError(f"unknown optimizer {name!r}; use one of {', '.join(OPTIMIZER_STATE)}")
    return name


@dataclass(frozen=True)
class DeviceMemory:
    """One device's memory terms (module docstring), in bytes."""

    params: float
    grads: float
    optimizer: float
    activations: float
    largest: float = 0.0
    buffers: float = 0.0
    grad_buckets: float = 0.0
    loss_grad: float = 0.0
    """``Y``: what the loss holds over the model's output on the device, from its forward
    into the backward (:func:`flexsearch.sim.footprint.loss_held_bytes`)."""
    rebuilt: float = 0.0
    """``C``: activation checkpointing: the activations one checkpointed unit rebuilds
    during the backward (the largest unit's), on top of those kept from the forward."""
    grad_working: float = 0.0
    """``W``: one backward's gradient buffers above the activations still kept and,
    under checkpointing, above the rebuilt ``C`` (:func:`flexsearch.sim.footprint.backward_working`);
    the peak takes the larger of ``C + W`` and ``T``, on top of ``Y``."""
    held_with_grads: float = 0.0
    """``H``: a pipeline stage's gradients and kept activations at once, after its first
    backward (module docstring)."""
    update_working: float = 0.0
    """``U``: the uncalibrated update's temporaries (:data:`UPDATE_WORKING` times the
    parameters the device updates)."""
    loss_working: float = 0.0
    """``T``: the loss's fp32 working tensor over the output share, beside ``Y``
    (:func:`flexsearch.sim.footprint.loss_working_bytes`)."""


def peak_branches(m: DeviceMemory, calibration: DeviceCalibration | None) -> dict[str, float]:
    """The three sums :func:`peak_bytes` takes the largest of (module docstring):
    ``backward`` (``A + Y + max(T, C + W)``), ``update`` (``G + U``) and ``held``
    (``H + Y + max(T, C + W)``; 0 outside pipelines)."""
    backward = m.loss_grad + max(m.loss_working, m.rebuilt + m.grad_working)
    update = m.update_working if calibration is None else calibration.optimizer_working_tensors.value * m.largest
    return {"backward": m.activations + backward, "update": m.grads + update,
            "held": m.held_with_grads + backward if m.held_with_grads else 0.0}


def peak_bytes(m: DeviceMemory, calibration: DeviceCalibration | None, mode: Mode) -> float:
    """The device's peak memory (module docstring)."""
    runtime = calibration.runtime(mode) if calibration is not None else 0.0
    return (m.params + m.optimizer + m.buffers + runtime + max(peak_branches(m, calibration).values())
            + m.grad_buckets)


def largest_tensor(shard_bytes: float, tensors: int) -> float:
    """The largest parameter tensor of a layer holding ``shard_bytes`` in ``tensors``
    tensors: the weight of a weight and a bias, one of two weights of four (an LSTM's)."""
    return shard_bytes if tensors <= 2 else 2 * shard_bytes / tensors


def stage_largest(largest: float, param_bytes: float) -> float:
    """A stage's largest tensor, ``param_bytes / 2`` when unknown (a stage of two or more
    layers)."""
    return largest or param_bytes / 2


def update_s(ctx: CostContext, optimizer: str, param_bytes: float, tensors: float, mode: Mode, *,
             sharded: bool = False) -> float:
    """Seconds of one device's optimizer update (module docstring) under ``ctx``'s
    device and calibration."""
    cal = ctx.calibration
    if cal is None:
        return roofline_update_s(ctx, optimizer, param_bytes)
    return cal.update_s(optimizer, tensors, param_bytes, sharded) + cal.step(mode)


def roofline_update_s(ctx: CostContext, optimizer: str, param_bytes: float) -> float:
    """The uncalibrated update (module docstring); also what a plan the emitter does not
    run (a parameter server) costs, calibration or not."""
    return elementwise_s(ctx, UPDATE_TRAFFIC[optimizer] * param_bytes)


def elementwise_s(ctx: CostContext, nbytes: float) -> float:
    """Seconds of a memory-bound fp32 pass moving ``nbytes`` on one device."""
    return roofline_time(Work(0.0, nbytes), ctx.cluster.device, "float32", "elementwise", ctx.efficiency)
