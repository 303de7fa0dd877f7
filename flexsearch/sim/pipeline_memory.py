"""Pipeline memory: what each device of a pipeline plan holds, from its lanes' actions.

Per device (:func:`pipeline_memory`): for each stage it hosts, ``P``
its parameter bytes, ``A q`` activations (``A`` stashed per microbatch, what the
stage keeps at its edges included, :class:`flexsearch.sim.stages.BoundaryCopies`; ``q`` the
peak number of microbatches in flight on it under the schedule); ``C + W`` one
microbatch's backward above its kept activations: activation recomputation keeps only
each microbatch's unit inputs and rebuilds one unit's activations, ``C``, during its
backward, ``W`` the gradient buffers above what is kept and rebuilt (a device runs one
backward at a time: the largest ``C + W`` of its stages, ``C`` the largest of
theirs); ``H`` the most it holds in
gradients and stashed microbatches at once after its first backward,
:func:`held_with_gradients`; on the stage that returns the output, the loss's saved
fp32 copy of a lower-precision output once per microbatch in flight, since torch's
pipelining computes each microbatch's loss in its forward action and keeps it to the
backward: :func:`microbatch_bytes`), summed into
:func:`flexsearch.sim.accounting.peak_bytes`; PipeDream adds one weight version per
extra minibatch in flight, ``P (q - 1)``, as a buffer. FSDP2 stages (``zero2``) hold
``P / d`` at rest with their gradients' and optimizer state's shards, and the gathered
parameters, ``g P``, as a buffer through the step; ``H`` counts their whole gradients,
which the runtime accumulates unsharded until the reduce-scatter after the last
backward (:data:`~flexsearch.strategy.kinds.PIPELINE_SHARDINGS`), with, gathered in bf16, a
unit's bf16 gradients beside them while a backward makes them, and keep no autocast weight copies
(:func:`flexsearch.sim.stages.stage_layout`). Not counted: the stages' receive
buffers, for the activation a stage receives and for its output's gradient. torch 2.13's
``PipelineStage`` makes one per microbatch each way and keeps them, memory linear in the
replica's batch (counted so, they made every layout of GPT-3 175B on 1024 H100s and of
Megatron's 1T row overflow 80 GB); the emitter keeps only those a microbatch in flight
may still need (:class:`flexsearch.emit.staged.ReusedBuffersStage`: under 1F1B the
stage's warm-up count of activations and one gradient; under GPipe every microbatch's
activation and one gradient; interleaved, torch's one per microbatch), a received
activation being what a checkpointed stage keeps of the microbatch (``A``). On the
zoo's tiny GPT they are 0.02-0.59 MB of a 2-4 MB peak (``tests/test_memory_tracker.py``).

:func:`peak_memory` gives the largest peak without scheduling the iteration (the
search's memory check before it simulates a layout).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from flexsearch.sim.accounting import (
    OPTIMIZER_STATE,
    UPDATE_WORKING,
    DeviceMemory,
    check_optimizer,
    peak_bytes,
    stage_largest,
)
from flexsearch.sim.context import CostContext
from flexsearch.sim.pipeline_layout import PipelineLayout, StageCost, lanes
from flexsearch.strategy.schedules import Action, in_flight

Occupancy = tuple[Mapping[int, int], float]
"""What memory needs of a lane's actions: per stage the peak microbatches in flight
(:func:`~flexsearch.strategy.schedules.in_flight`), and ``H``
(:func:`held_with_gradients`)."""


def occupancy(by_lane: Mapping[tuple[int, int], Sequence[Action]], costs: Sequence[StageCost],
              grad_copies: float = 1.0, schedule: str = "1f1b") -> dict[tuple[int, int], Occupancy]:
    """Each lane's :data:`Occupancy`, walking its actions (``grad_copies``: gradient
    bytes per parameter byte, :attr:`~flexsearch.sim.pipeline_layout.PipelineLayout.grad_copies`;
    ``schedule``: what its runtime keeps of the sends, :func:`kept_sends`)."""
    stash = {s: microbatch_bytes(c) for s, c in enumerate(costs)}
    stage_grads = {s: c.trains for s, c in enumerate(costs)}
    made = {s: c.trains * (grad_copies - 1) for s, c in enumerate(costs)}
    sends = kept_sends(costs, schedule)
    return {lane: (in_flight(acts), held_with_gradients(acts, stash, stage_grads, made, sends))
            for lane, acts in by_lane.items()}


def kept_sends(costs: Sequence[StageCost], schedule: str) -> Mapping[int, tuple[float, float]] | None:
    """Per stage, the bytes of a microbatch's sends that outlive its backward: torch 2.13's
    runtime of the interleaved schedule (``_PipelineScheduleRuntime._step_microbatches``)
    waits for every send at the step's end, and each pending send holds its tensors, so a
    stage keeps each microbatch's outputs (its ``send_bytes``) and the gradients of its
    inputs it sends back (the previous stage's ``send_bytes``) until then. Measured on
    the zoo's tiny GPT, 2 stages per rank (``tests/test_memory_tracker.py``): 0.33 MB a
    rank, the model 22% under its first rank's backward without them. None for the
    schedules whose runtime waits sooner (1F1B for each send at the next one; GPipe for the
    forwards' sends before the backwards, for the backwards' at the step's end, after the
    peak of their stashes)."""
    if schedule != "interleaved":
        return None
    last = len(costs) - 1
    return {s: (c.send_bytes if s < last else 0.0, costs[s - 1].send_bytes if s > 0 else 0.0)
            for s, c in enumerate(costs)}


def microbatch_bytes(c: StageCost) -> float:
    """What a stage keeps per microbatch in flight: its stash and the loss's saved copy."""
    return c.stash_bytes + c.loss_copy_bytes


def pipeline_memory(ctx: CostContext, costs: Sequence[StageCost], layout: PipelineLayout, optimizer: str,
                    by_lane: Mapping[tuple[int, int], Occupancy]) -> list[DeviceMemory]:
    """The memory terms per device (above), for :func:`peak_bytes`, from each
    lane's :data:`Occupancy`."""
    devices = ctx.cluster.devices
    params = [0.0] * devices
    trained = [0.0] * devices
    acts = [0.0] * devices
    largest = [0.0] * devices
    buffers = [0.0] * devices  # PipeDream's weight versions; FSDP2's gathered parameters
    rebuilt = [0.0] * devices
    loss = [0.0] * devices  # one microbatch's loss at a time
    loss_work = [0.0] * devices
    grads = [0.0] * devices  # one microbatch's backward at a time
    held = [0.0] * devices
    shards = [1] * devices  # ZeRO-1, FSDP2: the optimizer state over the rank's replicas
    for (r, i), (flight, h) in by_lane.items():
        for d in layout.ranks[r][i]:
            held[d] += h
            shards[d] = layout.shards(r)
        for s, q in flight.items():
            c_s = costs[s]
            for d in layout.ranks[r][i]:
                params[d] += c_s.param_bytes
                trained[d] += c_s.trains
                acts[d] += c_s.stash_bytes * q + c_s.loss_copy_bytes * (q - 1)  # the one run backward: in Y
                rebuilt[d] = max(rebuilt[d], c_s.working_bytes)  # one backward, one unit, at a time
                loss[d] = max(loss[d], c_s.loss_bytes)
                loss_work[d] = max(loss_work[d], c_s.loss_working_bytes)
                grads[d] = max(grads[d], c_s.working_bytes + c_s.grad_working_bytes)  # C + W, less C below
                largest[d] = max(largest[d], stage_largest(c_s.largest_param_bytes, c_s.param_bytes))
                if layout.asynchronous:
                    buffers[d] += c_s.param_bytes * (q - 1)
    grads = [g - c for g, c in zip(grads, rebuilt, strict=True)]  # C + W: the largest of its stages' (>= C)
    if layout.fsdp:  # FSDP2 stages: the shard at rest, the gathered parameters held through the step
        for d in range(devices):
            buffers[d] += layout.gather * params[d]
            params[d] /= shards[d]
            trained[d] /= shards[d]
            largest[d] /= shards[d]
        shards = [1] * devices
    ddp = layout.runtime == "ddp"  # DDP's gradient buckets: a flat copy of the gradients
    touched = {d for r, i in by_lane for d in layout.ranks[r][i]}
    idle = DeviceMemory(0.0, 0.0, 0.0, 0.0)  # a device none of the lanes given runs on
    state, working = OPTIMIZER_STATE[optimizer], UPDATE_WORKING[optimizer]
    return [DeviceMemory(params[d], trained[d], state * trained[d] / shards[d], acts[d], largest=largest[d],
                         buffers=buffers[d], grad_buckets=trained[d] if ddp else 0.0, loss_grad=loss[d],
                         rebuilt=rebuilt[d], grad_working=grads[d], held_with_grads=held[d],
                         update_working=working * trained[d] / shards[d], loss_working=loss_work[d])
            if d in touched else idle for d in range(devices)]


def held_with_gradients(actions: Sequence[Action], stash: Mapping[int, float], grads: Mapping[int, float],
                        making: Mapping[int, float] | None = None,
                        sends: Mapping[int, tuple[float, float]] | None = None) -> float:
    """The most one lane holds in gradients and kept activations at once, once its first
    backward has run (``H`` of :mod:`flexsearch.sim.accounting`; 0 before): walking its
    actions in order, at each backward the gradients of every stage that has begun its
    backward (``grads[s]`` bytes), those the backward makes before they join them
    (``making[s]``: an FSDP2 stage's low-precision gradients of one unit, added to the
    fp32 ones it accumulates at the unit's post-backward, :func:`~flexsearch.sim.pipeline_layout.fsdp_grad_copies`)
    and the stashes (``stash[s]`` bytes per microbatch, the loss's saved copy included:
    :func:`microbatch_bytes`) of the microbatches in flight but the one being run
    backward (whose activations the backward frees as it makes the gradients: ``W``),
    and after each later forward the gradients held with the new microbatch's stash;
    ``sends``: per stage, the bytes of a microbatch's sent outputs and sent input
    gradients the runtime keeps past its backward (:func:`kept_sends`), the outputs from
    that backward on, the gradients after it."""
    started: set[int] = set()
    kept = made = peak = pending = 0.0  # stashed bytes in flight; gradients made so far; sends kept
    for a in actions:
        if a.kind == "F":
            kept += stash[a.stage]
            if not started:
                continue
            peak = max(peak, made + kept + pending)
        else:
            kept -= stash[a.stage]
            if a.stage not in started:
                started.add(a.stage)
                made += grads[a.stage]
            out, back = sends[a.stage] if sends else (0.0, 0.0)
            pending += out
            peak = max(peak, made + (making[a.stage] if making else 0.0) + kept + pending)
            pending += back
    return peak


def peak_memory(ctx: CostContext, costs: Sequence[StageCost], layout: PipelineLayout,
                optimizer: str = "adam") -> float:
    """The largest per-device peak :func:`~flexsearch.sim.pipeline.simulate_pipeline` predicts, without scheduling
    the iteration: memory depends on each lane's actions, not on their times. A
    synchronous schedule's replicas of a rank hold the same (the same stages and
    actions), so replica 0's lanes are walked."""
    check_optimizer(optimizer)
    p, m = len(layout.ranks), layout.microbatches
    if layout.schedule in ("gpipe", "1f1b") and layout.chunks == 1:
        # closed forms (:func:`~flexsearch.strategy.schedules.rank_actions`): rank r runs
        # stage r with w = m (GPipe) or min(m, p - r) (1F1B) warm-up forwards, so w
        # microbatches in flight; at its first backward it holds the stage's gradients
        # (with those a backward makes before they join them) and w - 1 stashes, and the
        # gradients with w stashes if a forward follows (m > w): H of
        # :func:`held_with_gradients`
        occupied = {}
        for r in range(p):
            w = m if layout.schedule == "gpipe" else min(m, p - r)
            c = costs[r]
            held = c.trains * layout.grad_copies + (w - 1) * microbatch_bytes(c)
            if m > w:
                held = max(held, c.trains + w * microbatch_bytes(c))
            occupied[(r, 0)] = ({r: w}, held)
    else:
        by_lane = lanes(layout)
        if not layout.asynchronous:
            by_lane = {lane: acts for lane, acts in by_lane.items() if lane[1] == 0}
        occupied = occupancy(by_lane, costs, layout.grad_copies, layout.schedule)
    terms = pipeline_memory(ctx, costs, layout, optimizer, occupied)
    devices = {d for (r, i) in occupied for d in layout.ranks[r][i]}
    return max(peak_bytes(terms[d], ctx.calibration, layout.runtime) for d in devices)
