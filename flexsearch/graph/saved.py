"""What autograd saves for the backward, recorded while the tracer runs each op on fake
tensors (``OpNode.saved_bytes``).

Storages are the unit: a tensor and its views share one. Each op's outputs are
*owned* by the node that created them; while an op runs under
``torch.autograd.graph.saved_tensors_hooks`` every tensor autograd packs is either
another node's output (or this op's own), which marks that storage saved, or a tensor
the op made and keeps internally (a dropout mask, a norm's statistics, autocast's
low-precision copy of an activation), counted for the op. Parameters and buffers are
state, not activations; autocast's copies of weights are costed apart
(``flexsearch.sim.footprint.cast_copy_bytes``). A node's saved bytes are its owned
storages some op saved (or the model returns) plus what it saved internally.

A recurrent layer is traced decomposed (matmuls and pointwise ops the FLOP counter
sees), but trains as one fused kernel (oneDNN on a CPU, cuDNN on a GPU) that saves a
workspace of its own: :func:`fused_rnn_saved` measures it on this machine's kernel.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from flexsearch.graph.opgraph import OpNode


def storage(t: torch.Tensor) -> StorageWeakRef:
    return StorageWeakRef(t.untyped_storage())


class SavedTensors:
    """The bookkeeping of one trace (module docstring). Every tensor behind a key is
    held, so no storage is freed during the trace and its key reused."""

    def __init__(self, state: Iterable[torch.Tensor], param_ids: set[int] | dict[int, str]):
        self.state = {storage(t) for t in state}
        self.param_ids = param_ids
        self.owner: dict[StorageWeakRef, tuple[str, int]] = {}  # storage -> (node, bytes)
        self.saved: set[StorageWeakRef] = set()
        self.internal: dict[str, int] = {}
        self.sharing: dict[StorageWeakRef, list[str]] = {}  # storage -> the nodes whose outputs live in it
        self.saved_by: dict[str, set[StorageWeakRef]] = {}  # node -> the storages it saved
        self.clone_of: dict[StorageWeakRef, StorageWeakRef] = {}
        self._held: list[torch.Tensor] = []

    def key(self, t: torch.Tensor) -> StorageWeakRef:
        """The storage ``t`` lives in, as the program sees it (an op's fresh input clone
        stands for the tensor it was cloned from)."""
        k = storage(t)
        return self.clone_of.get(k, k)

    def cloned(self, copy: torch.Tensor, original: torch.Tensor) -> None:
        """``copy`` is a fresh clone the op runs on in place of ``original``."""
        self.clone_of[storage(copy)] = self.key(original)
        self._held.append(copy)

    def created(self, name: str, outputs: Iterable[torch.Tensor]) -> None:
        """Node ``name`` returned ``outputs``: it owns those storages no node owns yet."""
        for t in outputs:
            k = self.key(t)
            if k not in self.state and name not in self.sharing.get(k, ()):
                self.sharing.setdefault(k, []).append(name)
            if k not in self.owner and k not in self.state:
                self.owner[k] = (name, t.untyped_storage().nbytes())
                self._held.append(t)

    def returned(self, outputs: Iterable[torch.Tensor]) -> None:
        """The model returns ``outputs``: held for the loss and its backward."""
        self.saved.update(self.key(t) for t in outputs)

    def packed(self, name: str, packed: Iterable[torch.Tensor], outputs: Iterable[torch.Tensor]) -> None:
        """Record what autograd packed while op ``name`` ran (module docstring)."""
        outs = {self.key(t) for t in outputs}
        internal: dict[StorageWeakRef, int] = {}
        for t in packed:
            k = self.key(t)
            if k in self.state:
                continue
            if k in self.owner or k in outs:
                self.saved.add(k)
                self.saved_by.setdefault(name, set()).add(k)
            elif not self.is_weight_cast(t):
                internal[k] = t.untyped_storage().nbytes()
                self._held.append(t)
        if internal:
            self.internal[name] = self.internal.get(name, 0) + sum(internal.values())

    def is_weight_cast(self, t: torch.Tensor) -> bool:
        """Is ``t`` (a view of) autocast's low-precision copy of a parameter?"""
        fn, cast = t.grad_fn, False
        for _ in range(4):
            if fn is None:
                return False
            name = type(fn).__name__
            if name == "AccumulateGrad":
                return cast and id(fn.variable) in self.param_ids
            cast = cast or name == "ToCopyBackward0"
            nxt = [f for f, _ in fn.next_functions if f is not None]
            if len(nxt) != 1:
                return False
            fn = nxt[0]
        return False

    def saved_inputs(self) -> dict[str, set[str]]:
        """Per node, the nodes whose outputs live in a storage it saved for its backward
        (the storage's maker, its views, in-place results; the node itself when it saved
        its own output)."""
        return {name: {n for k in keys for n in self.sharing.get(k, ())} for name, keys in self.saved_by.items()}

    def saved_bytes(self) -> dict[str, int]:
        """Per node, the bytes of activations autograd keeps for the backward that the
        node created (module docstring)."""
        out = dict(self.internal)
        for k in self.saved:
            owner = self.owner.get(k)
            if owner is not None:
                out[owner[0]] = out.get(owner[0], 0) + owner[1]
        return out


FUSED_RNN_BATCH = 32
""":func:`fused_rnn_saved` runs the layer at the traced batch up to twice this, else at
this batch and twice it and extrapolates linearly."""


def fused_rnn_saved(module: nn.RNNBase, shape: tuple[int, ...], itemsize: int = 4) -> int | None:
    """Bytes the fused training kernel of ``module`` saves for the backward of an input
    of ``shape`` (sequence input; the module's own ``batch_first`` layout) whose
    activations have ``itemsize`` bytes per element: an fp32 copy of the layer with
    real weights runs forward on zeros under ``saved_tensors_hooks`` on this machine's
    kernel (oneDNN keeps a workspace of about 17 times an LSTM's output, GRU 7, RNN 1;
    the decomposed ops the tracer runs save about half an LSTM's) at the traced batch
    (beyond :data:`FUSED_RNN_BATCH` twice: at that batch and twice it, linear in the
    batch); the storages it packs, less its parameters and the input, scaled to
    ``itemsize``.
    None when the layer cannot run here (parameters on the meta device)."""
    if any(p.is_meta for p in module.parameters()) or len(shape) != 3:
        return None
    layer = copy.deepcopy(module).float().train()
    batch_dim = 0 if layer.batch_first else 1
    state = {storage(p) for p in layer.parameters()}

    def at(batch: int) -> int:
        size = list(shape)
        size[batch_dim] = batch
        x = torch.zeros(size, requires_grad=True)
        packed: dict[StorageWeakRef, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            packed.setdefault(storage(t), t.untyped_storage().nbytes())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = layer(x)
        del out
        skip = state | {storage(x)}
        return sum(n for k, n in packed.items() if k not in skip)

    full = shape[batch_dim]
    try:
        with torch.random.fork_rng(devices=[]):
            if full <= 2 * FUSED_RNN_BATCH:
                saved = at(full)
            else:  # linear beyond: small batches are padded (oneDNN's workspace at batch 1 is 2 samples' worth)
                lo, hi = at(FUSED_RNN_BATCH), at(2 * FUSED_RNN_BATCH)
                saved = lo + (hi - lo) * (full - FUSED_RNN_BATCH) // FUSED_RNN_BATCH
    except RuntimeError:
        return None
    return max(0, saved * itemsize // 4)


def fused_rnn_saves(model: nn.Module, nodes: Iterable[OpNode]) -> dict[str, int | None]:
    """Per recurrent node of ``model``'s trace, what its fused kernel saves
    (:func:`fused_rnn_saved`), in place of what its decomposed trace saved; None (the
    simulator's rule) where it cannot be measured."""
    out: dict[str, int | None] = {}
    nodes = list(nodes)
    by_name = {n.name: n for n in nodes}
    for n in nodes:
        if n.kind != "rnn" or not n.module or not n.inputs or n.inputs[0] not in by_name:
            continue
        try:
            mod = model.get_submodule(n.module)
        except AttributeError:
            mod = None
        src = by_name[n.inputs[0]].outputs
        if not isinstance(mod, nn.RNNBase) or not src:
            out[n.name] = None
            continue
        out[n.name] = fused_rnn_saved(mod, tuple(src[0].shape), getattr(torch, n.outputs[0].dtype).itemsize)
    return out
