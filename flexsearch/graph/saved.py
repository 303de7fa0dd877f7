"""What autograd saves for the backward, recorded while the tracer runs each op on fake
tensors (``OpNode.saved_bytes``).

Storages are the unit: a tensor and its views share one. Each op's outputs are
*owned* by the node that created them; while an op runs under
``torch.autograd.graph.saved_tensors_hooks`` every tensor autograd packs is either
another node's output (or this op's own), which marks that storage saved, or a tensor
the op made and keeps internally (a dropout mask, a norm's statistics, autocast's
low-precision copy of an activation), counted for the op. Parameters and buffers are
state, not activations; autocast's copies of weights are costed apart
(``flexsearch.sim.taskgraph.cast_copy_bytes``). A node's saved bytes are its owned
storages some op saved (or the model returns) plus what it saved internally.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.multiprocessing.reductions import StorageWeakRef


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
            elif not self._is_weight_cast(t):
                internal[k] = t.untyped_storage().nbytes()
                self._held.append(t)
        if internal:
            self.internal[name] = self.internal.get(name, 0) + sum(internal.values())

    def _is_weight_cast(self, t: torch.Tensor) -> bool:
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

    def saved_bytes(self) -> dict[str, int]:
        """Per node, the bytes of activations autograd keeps for the backward that the
        node created (module docstring)."""
        out = dict(self.internal)
        for k in self.saved:
            owner = self.owner.get(k)
            if owner is not None:
                out[owner[0]] = out.get(owner[0], 0) + owner[1]
        return out
