"""Which tensors carry gradients, and how the all-reduces of input gradients merge.

- :func:`without_gradient`: the ops whose output autograd gives no gradient (integer
  ids, boolean masks, tables computed from buffers and inputs only): the task graph
  (:func:`flexsearch.sim.taskgraph.build_fragment`) sends them none and runs no
  backward for them.
- :func:`merged_reductions`: the partial-sum all-reduces of one input's gradient that
  several readers hold alike (:attr:`flexsearch.sim.taskgraph.Fragment.reductions`)
  run once, as DTensor's autograd runs them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from flexsearch.graph.opgraph import OpNode
from flexsearch.sim.taskgraph import Fragment
from flexsearch.sim.tasks import Task
from flexsearch.strategy.config import is_source


def differentiable(dtype: str) -> bool:
    """Whether autograd carries a gradient for a tensor of ``dtype`` (floating point)."""
    return dtype.startswith(("float", "bfloat", "complex"))


def without_gradient(nodes: Sequence[OpNode], frozen: Iterable[str] = ()) -> frozenset[str]:
    """The ops (in topological order) whose output autograd gives no gradient: not
    floating point (token ids, boolean masks), or computed from no parameter that trains
    (model inputs, buffers and constants only: Llama's rotary cos and sin, a mask built
    from the input; the ``frozen`` parameters, by name: a fine-tuned model's frozen
    layers before its first trained one). Their readers send no gradient back to them,
    and they run no backward."""
    frozen = frozenset(frozen)
    carries: set[str] = set()
    out: set[str] = set()
    for n in nodes:
        if is_source(n):
            continue
        trains = any(p not in frozen for p in n.params)
        if n.outputs and differentiable(n.outputs[0].dtype) and (trains or any(i in carries for i in n.inputs)):
            carries.add(n.name)
        else:
            out.add(n.name)
    return frozenset(out)


def merged_reductions(frags: Sequence[Fragment]) -> list[list[Task]]:
    """Per fragment (graph order), the input-gradient all-reduces to run after its
    backward. Consumers that read one producer's output whole on the same group (q, k
    and v projections of one normalised input, Llama's gate and up projections) each
    hold a partial sum of its gradient; DTensor's autograd adds them as ``Partial``
    tensors and all-reduces once, when the producer's backward needs the gradient whole
    (seen with ``CommDebugMode`` on the emitted module: one ``all_reduce`` for three
    projections). So identical reductions (the same gradient keys, devices and bytes)
    are one task, waiting for every consumer's backward, run after the backward of the
    first consumer in graph order (the last to run its backward)."""
    out: list[list[Task | None]] = [[] for _ in frags]
    seen: dict[tuple, tuple[int, int]] = {}  # reduction -> (fragment, position in its list)
    for i in reversed(range(len(frags))):  # the later consumers first: their backward runs first
        for t in frags[i].reductions:
            key = (t.defines, t.resources, t.nbytes)
            hit = seen.pop(key, None)
            if hit is not None:
                j, pos = hit
                t = t._replace(deps=out[j][pos].deps + t.deps)
                out[j][pos] = None  # moved to this (earlier) consumer
            seen[key] = (i, len(out[i]))
            out[i].append(t)
    return [[t for t in ts if t is not None] for ts in out]
