"""What a node holds in memory: the bytes each memory term of
:mod:`flexsearch.sim.accounting` is made of, per op (whole; the task graph divides them
by the op's split, :func:`flexsearch.sim.taskgraph.activation_split`).

- :func:`kept_bytes`: the activations autograd saves for the backward (``A``);
- :func:`grad_bytes` and :func:`backward_working`: the gradient buffers of a backward
  above what it still keeps (``W``);
- :func:`loss_operands`, :func:`loss_held_bytes`, :func:`loss_copy_bytes` and
  :func:`loss_working_bytes`: what a loss over the model's output holds (``Y``), of
  that what it saves per microbatch, and its working tensor beside it (``T``);
- :func:`cast_copy_bytes`: autocast's low-precision copy of the weights an op reads.
"""

from __future__ import annotations

from collections.abc import Sequence

from flexsearch.graph.opgraph import OpNode, dtype_size
from flexsearch.precision import Precision

_COPYING_VIEWS = frozenset({"Tensor.repeat", "Tensor.contiguous", "torch.repeat_interleave",
                            "torch._VariableFunctionsClass.arange", "torch.arange", "torch.cat", "torch.stack"})
"""Ops the registry classes as views that write new memory (copies, factories)."""
_RNN_SAVED = {"LSTM": 6, "GRU": 5, "RNN": 2, "LSTMCell": 6, "GRUCell": 5, "RNNCell": 2}
"""Bytes a recurrent layer keeps for its backward per byte of its sequence output: per
step the gates (LSTM 4, GRU 3, RNN 1 times the hidden size), the cell state (LSTM) and
the hidden output itself."""


def kept_bytes(node: OpNode) -> float:
    """Bytes of activations ``node`` keeps for the backward pass (whole op): what
    autograd saves that the node created, as the tracer measured it
    (``OpNode.saved_bytes``; a recurrent layer's as its fused kernel saves them,
    :func:`flexsearch.graph.saved.fused_rnn_saved`). Without a measurement (a profile
    from elsewhere, a layer on the meta device): a recurrent layer's gates and states by
    :data:`_RNN_SAVED`, else its outputs, none for a view (:func:`aliases`)."""
    if node.saved_bytes is not None:
        return float(node.saved_bytes)
    if node.bytes_written <= 0 or aliases(node):
        return 0.0
    if node.kind == "rnn" and node.outputs:
        factor = _RNN_SAVED.get(node.target.rsplit(".", 1)[-1])
        if factor is not None:
            return float(factor * node.outputs[0].nbytes + sum(t.nbytes for t in node.outputs[1:]))
    return float(node.output_bytes)


def grad_bytes(node: OpNode) -> float:
    """The gradient buffer of ``node``'s output in the backward (whole op): its output
    bytes (a view's too: its consumer's backward makes it, and the view's backward
    views it, :func:`backward_working`), none for an integer output, the batch or the
    graph's output node (its producer's output). A loss the model computes itself (a
    0-dim output) holds the gradient of its input: a fused cross-entropy holds, beside
    it, the NLL's gradient of the log-probabilities, as large (the bytes it reads, its
    integer targets with them); measured on an H100 (``benchmarks/gpu_step.py``: the
    backward of Hugging Face's GPT-2 and Llama rises 8 bytes per logit above their
    forwards, two fp32 logit-sized gradients)."""
    floating = bool(node.outputs) and node.outputs[0].dtype.startswith(("float", "bfloat"))
    if not floating or node.kind in ("input", "output"):
        return 0.0
    if not node.outputs[0].shape and "cross_entropy" in node.target:
        return float(max(0, node.bytes_read - node.param_bytes))
    return float(node.output_bytes)


def rebuilt_peaks(rebuilt: Sequence[float], units: Sequence[int]) -> dict[int, float]:
    """Per unit (``units[i]``: node ``i``'s, -1 for none), the most its recomputation
    holds at once, ``C_u``: the largest running sum of its nodes' rebuilt bytes in forward
    order, at least 0. The recomputation runs forward; a cached output no op saves
    (selective checkpointing, a negative share) is freed after the ops before it have
    rebuilt theirs, so the unit's sum alone would miss what they hold before it goes."""
    run: dict[int, float] = {}
    peak: dict[int, float] = {}
    for r, u in zip(rebuilt, units, strict=False):
        if u >= 0:
            run[u] = run.get(u, 0.0) + r
            peak[u] = max(peak.get(u, 0.0), run[u])
    return peak


def backward_working(kept: Sequence[float], grads: Sequence[float], received: float = 0.0,
                     views: Sequence[bool] = (), rebuilt: Sequence[float] = (), units: Sequence[int] = (),
                     held: Sequence[float] = ()) -> float:
    """``W``: the gradient buffers of one backward through a sequence of nodes (forward
    order; ``kept[i]`` the activations node ``i`` keeps, ``grads[i]`` its output's
    gradient buffer, ``views[i]`` whether it is a view, :func:`aliases`) above the
    activations they keep. Backpropagating node ``i``, the activations of the nodes
    before it are still kept, those after it are freed, and two gradients are alive:
    of its output and of its input (the node before it's; for the first, the gradient
    of an input it ``received`` from another device or stage), one for a view (its
    input's gradient is a view of its output's): ``max_i (kept[..i] - kept[..] +
    grads[i] + grads[i - 1])``, at least 0. A chain's rule: a gradient waiting for a
    second consumer (a residual) is not counted.

    Under activation checkpointing (``rebuilt[i]``: the activations node ``i`` rebuilds
    when its unit reruns its forward, ``units[i]``: its unit, -1 for none), a unit's
    backward first rebuilds them, then frees them as it goes back through the unit,
    as it frees kept ones; the peak adds the largest unit's rebuilt bytes ``C``
    (:func:`rebuilt_peaks`, :mod:`flexsearch.sim.accounting`), so each term here adds
    the rebuilt bytes of node ``i``'s unit up to it, less ``C``:
    ``max_i (kept[..i] - kept[..] + rebuilt_{u_i}[..i] - C + grads[i] + grads[i - 1])``.
    Counting the gradients over the kept bytes alone (as without checkpointing) and
    adding ``C`` counted the rebuilt activations twice: the tiny AlexNet (one unit) at
    batch 128 was predicted 37% over torch's allocator with full checkpointing, 8% under
    without it (``tests/test_memory_tracker.py``).

    ``held[i]``: of ``kept[i]``, the bytes the backward frees at no node, which stay
    through it: the model's outputs, which the step's caller references until the
    backward is over (``out = model(x); loss_fn(out, y).backward()``; torch's pipeline
    schedule holds a microbatch's output through its backward), and which the tracer
    counts among their producer's kept bytes (:mod:`flexsearch.graph.saved`).
    Freeing them once the backward had passed their producer put the fully
    checkpointed tiny GPT's rise (Megatron's layout, t = 2, fp32: its whole all-reduced
    logits, 0.52 MB) 8-18% under torch's allocator, whose peak, in the last block's
    recomputed backward, still held them (``tests/test_memory_tracker.py``)."""
    freed = [k - (held[i] if i < len(held) else 0.0) for i, k in enumerate(kept)]
    total = sum(freed)
    largest = max(rebuilt_peaks(rebuilt, units).values(), default=0.0)  # C
    alive: dict[int, float] = {}  # per unit, what it has rebuilt up to the node
    prefix = work = 0.0
    for i, k in enumerate(freed):
        prefix += k
        here = 0.0
        if i < len(units) and units[i] >= 0:
            alive[units[i]] = here = alive.get(units[i], 0.0) + (rebuilt[i] if i < len(rebuilt) else 0.0)
        made = 0.0 if i < len(views) and views[i] else grads[i - 1] if i else received
        work = max(work, prefix - total + here - largest + grads[i] + made)
    return work


def loss_operands(graph) -> tuple[str, ...]:
    """The nodes whose outputs a loss outside the model reads: the producers of the
    model's outputs; none when the model returns its own loss (a 0-dim output, traced
    with the rest)."""
    for n in graph.nodes:
        if n.kind == "output":
            return () if any(not t.shape for t in n.outputs) else n.inputs
    return ()


def loss_held_bytes(node: OpNode, share: float) -> float:
    """Bytes a loss computed in fp32 over ``share`` bytes of ``node``'s output holds
    from its forward into the backward (``Y`` of :mod:`flexsearch.sim.accounting`): one
    output-sized fp32 tensor, and the fp32 copy of a lower-precision output it saves
    (autocast runs losses in fp32). Measured with ``MemTracker``
    (``tests/test_memory_tracker.py``: torch's CPU ``mse_loss`` returns its loss as a
    view of its elementwise buffer, which lives as long as the loss) and on an H100
    (``benchmarks/gpu_step.py``: the cross-entropy's fp32 copy of bf16 logits and its
    log-softmax, within 2% of the allocator's peak in the loss on every row)."""
    if not node.outputs:
        return 0.0
    return loss_working_bytes(node, share) + loss_copy_bytes(node, share)


def loss_working_bytes(node: OpNode, share: float) -> float:
    """``T``: one output-sized fp32 tensor over ``share`` bytes of ``node``'s output, the
    loss's working tensor beside what it holds: the MSE's elementwise temporary in its
    forward, the gradient of the output a loss computes in fp32 in its backward before
    it is cast to the output's dtype (the cross-entropy's beside its saved log-softmax,
    measured on an H100: ``benchmarks/gpu_step.py``)."""
    return share * 4 / dtype_size(node.outputs[0].dtype) if node.outputs else 0.0


def loss_copy_bytes(node: OpNode, share: float) -> float:
    """The part of :func:`loss_held_bytes` a loss saves for its backward: the fp32 copy of
    a lower-precision output share (0 for an fp32 output, which it saves as it is and
    the runtime keeps anyway). A pipeline keeps one per microbatch in flight on the
    stage that returns the output (:func:`flexsearch.sim.pipeline_memory.pipeline_memory`)."""
    if not node.outputs:
        return 0.0
    size = dtype_size(node.outputs[0].dtype)
    return share * 4 / size if size < 4 else 0.0


def cast_copy_bytes(node: OpNode, precision: Precision) -> float:
    """Bytes of the low-precision copy of its weights that ``node`` makes under
    autocast: every parameter it reads, when it computes in the autocast dtype from
    wider parameters (0 for other precisions and for ops autocast leaves alone)."""
    low = precision.autocast
    if low is None or not node.used_param_bytes or not node.outputs or node.outputs[0].dtype != low:
        return 0.0
    per_param = node.param_bytes / node.num_params if node.num_params else 4.0
    return node.used_param_bytes * dtype_size(low) / max(per_param, dtype_size(low))


def aliases(node: OpNode) -> bool:
    """Does the node's output share its input's storage (a view: no new memory kept)?"""
    return node.kind == "view" and node.target not in _COPYING_VIEWS
