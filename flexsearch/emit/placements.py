"""The placements an op's configuration gives its inputs and parameters on its ``(s, t)``
device mesh (the SOAP emitter's rules, :mod:`flexsearch.emit.sharded`):

- **inputs**: ``Shard(b)`` on ``s`` (``b`` the input dim the op's batch dim reads) and, on
  ``t``, ``Shard`` of the input dim an attribute split reads, ``Shard`` of the reduced
  dim for a reduce split (row-wise Linear, ``k`` of a matmul), else ``Replicate``;
- **parameters**: ``Replicate`` on ``s``; on ``t`` ``Shard(0)`` of Linear/Conv/Norm
  weights and biases for a parameter split (column-wise), ``Shard(1)`` of a Linear
  weight for a reduce split (row-wise); an Embedding table by columns or by vocabulary;
  an exported graph's weight arguments the same way (:func:`arg_placement`).
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch import nn
from torch.distributed.tensor import Placement, Replicate, Shard

from flexsearch.graph.microbatch import batch_dim
from flexsearch.graph.opgraph import OpNode
from flexsearch.graph.regions import dim_map, reduced_input_dims
from flexsearch.strategy.config import Config

REPLICATE = (Replicate(), Replicate())
"""Whole on both mesh dims."""


def input_placements(node: OpNode, k: int, shape: tuple[int, ...], c: Config) -> tuple[Placement, Placement]:
    """Placements on the ``(s, t)`` mesh of input ``k`` (of ``shape``) of ``node`` under ``c``."""
    dmap = dim_map(node, k, shape) if node.outputs else ()
    out_shape = node.outputs[0].shape if node.outputs else ()

    def shard_of(out_dim: int | None) -> Placement:
        if out_dim is None or out_dim >= len(dmap) or dmap[out_dim] is None:
            return Replicate()
        i = dmap[out_dim][0]
        return Shard(i) if shape[i] == out_shape[out_dim] else Replicate()

    s_pl = shard_of(batch_dim(node)) if c.s > 1 else Replicate()
    t_pl: Placement = Replicate()
    if c.kind == "a":
        t_pl = shard_of(c.dim)
    elif c.kind == "r":
        dims = reduced_input_dims(node, k, shape)
        t_pl = Shard(dims[0]) if dims else Replicate()
    return s_pl, t_pl


def param_placement(module: nn.Module, name: str, c: Config) -> tuple[Placement, Placement]:
    """Placements of ``module``'s parameter ``name`` for an op configured ``c``."""
    if c.t == 1 or c.kind not in ("p", "r") or tensor_dim(module, name) == 0:
        return REPLICATE
    if isinstance(module, nn.Embedding):
        return (Replicate(), Shard(1) if c.kind == "p" else Shard(0))
    if c.kind == "p" and isinstance(module, (nn.Linear, nn.modules.conv._ConvNd, nn.modules.batchnorm._NormBase,
                                             nn.GroupNorm)):
        return (Replicate(), Shard(0))
    if c.kind == "r" and isinstance(module, nn.Linear) and name == "weight":
        return (Replicate(), Shard(1))
    return REPLICATE


_LINEAR, _ADDMM = {1: (0, 1), 2: (0, None)}, {0: (0, None), 2: (1, 0)}
_WEIGHT_SPLITS = {torch.ops.aten.linear.default: _LINEAR, nn.functional.linear: _LINEAR,
                  torch.ops.aten.addmm.default: _ADDMM, torch.addmm: _ADDMM,
                  torch.ops.aten.embedding.default: {0: (1, None)}}
"""Per ATen op of an exported graph, per argument index that is a weight: the dim it is
split on ``t`` for a parameter split and for a reduce split (None: replicated), as
:func:`param_placement` splits a layer's: a Linear's weight and bias column-wise (dim
0) or its weight row-wise (dim 1), ``addmm``'s transposed weight the other way round;
an Embedding's table by columns."""


def arg_placement(n: fx.Node, k: int, c: Config) -> tuple[Placement, Placement]:
    """Placements of argument ``k`` of ATen op node ``n`` (a weight an exported graph
    passes as an argument) for an op configured ``c``."""
    split = _WEIGHT_SPLITS.get(n.target, {}).get(k)
    if c.t == 1 or c.kind not in ("p", "r") or split is None:
        return REPLICATE
    d = split[0 if c.kind == "p" else 1]
    return REPLICATE if d is None else (Replicate(), Shard(d))


def tensor_dim(module: nn.Module, name: str) -> int:
    """Rank of ``module``'s parameter or buffer ``name``."""
    return module.get_parameter(name).dim() if name in dict(module.named_parameters()) else \
        module.get_buffer(name).dim()
