"""Named strategies: the baselines every search is judged against, and the tensor-parallel
layout of hybrid pipeline stages. Each is simulated by the same simulator as every
searched plan.

- ``data``: every decision op data parallel over all devices (the largest legal
  sample split, replicated on the rest; :meth:`Space.data_parallel`).
- ``megatron`` (models with attention or repeated blocks holding Linears): tensor
  parallel of degree ``t`` inside a node times data parallel ``N / t``. In each block
  the Linears alternate column-parallel (parameter split of the out features) and
  row-parallel (reduce split of the in features, one all-reduce after) along the
  data flow (:func:`linear_depths`: separate q, k and v projections are all
  column-parallel, the projection after attention row-parallel), attention is
  split by heads (fused, or unfused: its two batched products of 4-D tensors),
  embeddings vocab-parallel, Linears outside blocks column-parallel,
  everything else replicated on the tensor-parallel group. :func:`megatron` returns
  one strategy per ``t`` in 2, 4, ... up to the devices of a node; the planner keeps
  the fastest.
- ``expert`` (CNNs, FlexFlow's expert plan after Krizhevsky's "one weird trick"): data
  parallel everywhere except the fully-connected layers after the convolutions, which
  are parameter-parallel over all devices.

- ``stage_configs``: a pipeline stage's layout on its ``t`` tensor-parallel devices,
  whole ops for ``t = 1``, else Megatron's (what the emitter runs inside a hybrid stage).

A baseline configuration that is not legal for some op (a dim that does not divide)
falls back to the replicated form of the same mesh, then to data parallel.
"""

from __future__ import annotations

from flexsearch.graph.opgraph import OpGraph
from flexsearch.strategy.config import Config
from flexsearch.strategy.space import Space, Unit


def data_parallel(space: Space) -> dict[str, Config]:
    return {u.name: space.data_parallel(u) for u in space.units}


def _pick(space: Space, unit: Unit, *options: Config) -> Config:
    for c in options:
        if space.allows(unit, c):
            return c
    return space.data_parallel(unit)


def _last_dim(space: Space, unit: Unit) -> int:
    return len(space.graph.node(unit.name).outputs[0].shape) - 1


def is_transformer(space: Space) -> bool:
    g = space.graph
    return any(n.kind == "attention" for n in g.nodes) or any(
        any(g.node(nm).kind == "linear" for nm in b.instances[0]) for b in g.blocks
    )


def is_cnn(space: Space) -> bool:
    return any(n.kind == "conv" for n in space.graph.nodes)


def linear_depths(graph: OpGraph) -> dict[str, int]:
    """Per Linear of a repeated block's first instance, the most Linears on a data-flow
    path from the block's inputs to it (itself excluded): Megatron's layout splits the
    Linears at even depth by columns and those at odd depth by rows, so each row-parallel
    Linear reads a column-parallel one's split output and one all-reduce closes each
    pair. GPT's ``c_attn`` (or ``q_proj``, ``k_proj``, ``v_proj``, all at depth 0) ->
    attention -> ``c_proj`` (1) -> residual, norm -> ``c_fc`` (2) -> ``c_proj`` (3);
    Llama's MLP (a block of its own): ``gate_proj`` and ``up_proj`` (0) -> ``down_proj``
    (1). Counting Linears in program order instead split ``k_proj`` by rows: an
    all-reduce more each way per layer."""
    out: dict[str, int] = {}
    for b in graph.blocks:
        depth: dict[str, int] = {}
        for nm in b.instances[0]:  # program order is a topological order
            node = graph.node(nm)
            depth[nm] = max((depth[i] + (graph.node(i).kind == "linear") for i in node.inputs if i in depth),
                            default=0)
            if node.kind == "linear":
                out[nm] = depth[nm]
    return out


def megatron(space: Space, t: int) -> dict[str, Config]:
    """Megatron-style tensor parallel of degree ``t`` times data parallel (docstring)."""
    n = space.devices
    s = n // t
    rep = Config(s, "x", t)
    g = space.graph
    order = linear_depths(g)  # column/row alternation along the data flow
    out: dict[str, Config] = {}
    for u in space.units:
        node = g.node(u.name)
        last = _last_dim(space, u)
        if node.kind == "linear":
            col = Config(s, "p", t, last)
            row = Config(s, "r", t, 0)
            first, second = (col, row) if order.get(u.name, 0) % 2 == 0 else (row, col)
            out[u.name] = _pick(space, u, first, second, rep)
        elif node.kind == "attention" or (node.kind == "matmul" and last == 3):
            # heads (dim 1 of (batch, heads, T, *)): fused attention, or its unfused
            # products q k^T and scores @ v (the mask, softmax and dropout follow them)
            out[u.name] = _pick(space, u, Config(s, "a", t, 1), rep)
        elif node.kind == "embedding":
            out[u.name] = _pick(space, u, Config(s, "r", t, 0), Config(s, "p", t, last), rep)
        else:
            out[u.name] = _pick(space, u, rep)
    return out


def megatron_degrees(space: Space, devices_per_node: int) -> list[int]:
    """Tensor-parallel degrees to try: powers of two from 2 up to a node's devices."""
    out, t = [], 2
    while t <= min(devices_per_node, space.devices):
        if space.devices % t == 0:
            out.append(t)
        t *= 2
    return out


def expert(space: Space) -> dict[str, Config]:
    """FlexFlow's expert plan for CNNs: data parallel, with the fully-connected layers
    that come after the last convolution parameter-parallel over all devices."""
    g = space.graph
    last_conv = max((i for i, nd in enumerate(g.nodes) if nd.kind == "conv"), default=-1)
    after = {nd.name for nd in g.nodes[last_conv + 1:]}
    out = data_parallel(space)
    for u in space.units:
        node = g.node(u.name)
        if node.kind == "linear" and u.name in after:
            out[u.name] = _pick(space, u, Config(1, "p", space.devices, _last_dim(space, u)))
    return out


def baselines(space: Space, devices_per_node: int) -> dict[str, dict[str, Config]]:
    """Every applicable baseline, by name (``megatron-t{t}`` per degree)."""
    out = {"data": data_parallel(space)}
    if is_transformer(space):
        for t in megatron_degrees(space, devices_per_node):
            out[f"megatron-t{t}"] = megatron(space, t)
    if is_cnn(space):
        out["expert"] = expert(space)
    return out


def stage_configs(graph: OpGraph, t: int) -> dict[str, Config] | None:
    """Each node's configuration on a stage's tensor-parallel group of ``t`` devices:
    whole ops for ``t = 1``, the Megatron-style plan otherwise (None if not legal)."""
    space = Space(graph, t)
    if t == 1:
        return space.expand({})
    if not is_transformer(space):
        return None
    dec = megatron(space, t)
    configs = space.expand(dec)
    if not any(c.t == t for c in configs.values()):
        return None
    return configs
