"""The memory terms of an op-level simulation (:mod:`.simulator`) that span its
fragments, per device (:class:`~flexsearch.sim.accounting.DeviceMemory`): what the
loss holds over the model's outputs and its working tensor (``Y``, ``T``), and the
backward's gradient buffers above the activations it still keeps (``W``), the model's
outputs held through it (:func:`~flexsearch.sim.footprint.backward_working`'s ``held``:
the step's caller references them until the backward is over)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

from flexsearch.graph.opgraph import OpGraph
from flexsearch.sim.footprint import (
    backward_working,
    loss_held_bytes,
    loss_operands,
    loss_working_bytes,
)
from flexsearch.sim.taskgraph import Fragment, activation_split
from flexsearch.strategy.config import Config

if TYPE_CHECKING:
    from flexsearch.sim.simulator import Rebuilt


def loss_terms(graph: OpGraph, configs: Mapping[str, Config] | None, devices: int,
               whole: bool = False) -> tuple[dict[int, float], dict[int, float]]:
    """Per device, the bytes the loss holds over its share of the model's outputs
    (``Y``, :func:`~flexsearch.sim.footprint.loss_held_bytes`) and its working
    tensor (``T``, :func:`~flexsearch.sim.footprint.loss_working_bytes`); ``whole``:
    over all of them on every one of ``devices`` (the SOAP emitter's loss,
    :func:`~flexsearch.sim.taskgraph.output_gather`)."""
    held: dict[int, float] = {}
    work: dict[int, float] = {}
    if configs is None:
        return held, work
    for name in loss_operands(graph):
        p, c = graph.node(name), configs.get(name)
        if c is None or not p.outputs:
            continue
        share = p.outputs[0].nbytes / (1 if whole else activation_split(c, p))
        y, t = loss_held_bytes(p, share), loss_working_bytes(p, share)
        for d in range(devices) if whole else c.devices:
            held[d] = held.get(d, 0.0) + y
            work[d] = work.get(d, 0.0) + t
    return held, work


def output_shares(graph: OpGraph, configs: Mapping[str, Config] | None) -> dict[str, float]:
    """Per node, the bytes of the model's outputs among what it keeps on each of its
    devices: a loss operand's output share (:func:`~flexsearch.sim.footprint.loss_operands`;
    the tracer counts a returned output as its producer's kept bytes), everything the
    output node keeps (:func:`~flexsearch.sim.taskgraph.output_gather`)."""
    out = {n.name: math.inf for n in graph.nodes if n.kind == "output"}
    for name in loss_operands(graph) if configs is not None else ():
        p, c = graph.node(name), configs.get(name)
        if c is not None and p.outputs:
            out[name] = p.outputs[0].nbytes / activation_split(c, p)
    return out


def backward_working_per_device(graph: OpGraph, frags: list[Fragment], configs: Mapping[str, Config] | None,
                                rebuilt: Rebuilt | None = None) -> dict[int, float]:
    """``W`` per device (:func:`~flexsearch.sim.footprint.backward_working`) over the
    nodes it keeps activations or gradients of or (checkpointed, ``rebuilt``) rebuilds
    activations of, in graph order (``frags[i]`` node ``i``'s; one pass over the
    fragments' entries, not devices x nodes), the model's outputs held through the
    backward (:func:`output_shares`)."""
    kept: dict[int, list[float]] = {}
    grads: dict[int, list[float]] = {}
    views: dict[int, list[bool]] = {}
    held: dict[int, list[float]] = {}
    again: dict[int, list[float]] = {}
    units: dict[int, list[int]] = {}
    outputs = output_shares(graph, configs)
    for i, f in enumerate(frags):
        shares = rebuilt.per_node[i] if rebuilt is not None else {}
        out = outputs.get(graph.nodes[i].name, 0.0)
        for d in f.activations.keys() | f.grads.keys() | shares.keys():
            k, g, r = f.activations.get(d, 0.0), f.grads.get(d, 0.0), shares.get(d, 0.0)
            if k or g or r:
                kept.setdefault(d, []).append(k)
                grads.setdefault(d, []).append(g)
                views.setdefault(d, []).append(f.view)
                held.setdefault(d, []).append(min(k, out))
                if rebuilt is not None:
                    again.setdefault(d, []).append(r)
                    units.setdefault(d, []).append(rebuilt.unit_of[i])
    return {d: backward_working(kept[d], grads[d], views=views[d], rebuilt=again.get(d, ()), units=units.get(d, ()),
                                held=held[d])
            for d in kept}
