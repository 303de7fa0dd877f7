"""The operator graph of one microbatch: the batch split ``k`` ways.

A pipeline runs each stage on microbatches of ``B / k`` samples. Every tensor that
carries the batch (the output dim of kind ``sample``) shrinks by ``k``; every op whose
output or inputs carry the batch does ``1/k`` of its FLOPs, reads ``1/k`` of its
activation bytes (parameters are read whole) and writes ``1/k`` of its output. Ops with
no batch (parameters, positions) are unchanged. The result is an ordinary
:class:`~flexsearch.graph.opgraph.OpGraph`, so the configuration space, the cost model
and the simulator apply to microbatches unchanged.
"""

from __future__ import annotations

from flexsearch.graph.opgraph import OpGraph, OpNode, TensorMeta


def batch_dim(node: OpNode) -> int | None:
    """The output dim that carries the batch, if any."""
    for d in node.dims.output:
        if d.kind == "sample":
            return d.dim
    return None


def batch_size(graph: OpGraph) -> int:
    """The global batch: the batch extent of the graph's first batched tensor."""
    for node in graph.nodes:
        d = batch_dim(node)
        if d is not None:
            return node.outputs[0].shape[d]
    raise ValueError(f"graph {graph.model!r} has no batch dimension; it cannot be split into microbatches")


def microbatch_graph(graph: OpGraph, k: int) -> OpGraph:
    """``graph`` with every batch extent divided by ``k`` (module docstring). Raises
    ValueError if some batch extent is not divisible by ``k``."""
    if k == 1:
        return graph
    if k < 1:
        raise ValueError(f"microbatch count must be >= 1 (got {k})")
    total = batch_size(graph)
    if total % k:
        raise ValueError(f"batch {total} is not divisible by {k} microbatches; choose a count that divides it")
    sizes = param_sizes(graph)
    batched: set[str] = set()
    nodes: list[OpNode] = []
    for node in graph.nodes:
        d = batch_dim(node)
        if d is None and node.kind == "input" and node.outputs and node.outputs[0].shape[:1] == (total,):
            d = 0
        if d is None:
            if not any(i in batched for i in node.inputs):
                nodes.append(node)
                continue
            extent = total
        else:
            extent = node.outputs[0].shape[d]
            if extent % k:
                raise ValueError(
                    f"{node.name}: batch extent {extent} is not divisible by {k} microbatches; "
                    "choose a microbatch count that divides the batch"
                )
        outputs = tuple(_shrink(t, d, extent, k) for t in node.outputs)
        batched.add(node.name)
        params = min(sum(sizes.get(p, 0) for p in node.params), node.bytes_read)
        nodes.append(node.model_copy(update={
            "outputs": outputs,
            "flops": node.flops // k,
            "backward_flops": node.backward_flops // k,
            "bytes_read": params + (node.bytes_read - params) // k,
            "bytes_written": sum(t.nbytes for t in outputs) if node.bytes_written else 0,
            "saved_bytes": None if node.saved_bytes is None else node.saved_bytes // k,
        }))
    return OpGraph(model=graph.model, via=graph.via, nodes=tuple(nodes), blocks=graph.blocks,
                   unused_params=graph.unused_params, frozen_params=graph.frozen_params)


def param_sizes(graph: OpGraph) -> dict[str, int]:
    """Bytes per parameter name, from the node that owns it (a tied weight is owned once)."""
    out: dict[str, int] = {}
    for node in graph.nodes:
        if node.param_bytes and node.params:
            for p in node.params:
                out.setdefault(p, node.param_bytes // len(node.params))
    return out


def _shrink(t: TensorMeta, dim: int | None, extent: int, k: int) -> TensorMeta:
    shape = list(t.shape)
    if dim is not None and dim < len(shape) and shape[dim] == extent:
        shape[dim] //= k
    else:  # an auxiliary output (e.g. an RNN's state): its own batch dim, if it has one
        for i, s in enumerate(shape):
            if s == extent:
                shape[i] //= k
                break
    return t.model_copy(update={"shape": tuple(shape)})
