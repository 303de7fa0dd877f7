"""Moving DTensors between the meshes and placements of a SOAP plan: a tensor brought to
an op's layout (:func:`to_layout`: DTensor's redistribution within a mesh, a broadcast
between meshes), the device meshes and groups every rank makes in the same order
(:func:`build_layouts`), and the autograd functions at a mesh's edges (a whole tensor
out of a replicated DTensor, a rank's stand-in for a DTensor it holds no data of, a
partial-sum gradient reduced where it arrives)."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate

from flexsearch.emit.placements import REPLICATE
from flexsearch.emit.runtime import Runtime
from flexsearch.strategy.config import Config


def _mesh_ranks(mesh) -> frozenset[int]:
    return frozenset(mesh.mesh.flatten().tolist())


def dense_stride(shape) -> tuple[int, ...]:
    return torch.empty(shape, device="meta").stride()


def _empty(mesh, placements, shape, dtype, device) -> DTensor:
    """A DTensor on ``mesh`` as a rank outside it holds it: global metadata, no data."""
    return DTensor.from_local(torch.empty(0, dtype=dtype, device=device), mesh, placements,
                              run_check=False, shape=torch.Size(shape),
                              stride=dense_stride(shape))


def _transfer(rt: Runtime, x: DTensor, dst, placements) -> DTensor:
    """``x`` gathered on its mesh and sent to the ranks of ``dst`` (no autograd)."""
    src = x.device_mesh
    src_ranks, dst_ranks = _mesh_ranks(src), _mesh_ranks(dst)
    shape, dtype = tuple(x.shape), x.dtype
    device = x.to_local().device
    full = None
    if rt.rank in src_ranks:
        full = x.redistribute(src, (Replicate(),) * src.ndim).to_local().contiguous()
    group = rt.subgroup(tuple(src_ranks | dst_ranks))
    if not dst_ranks <= src_ranks and group is not None:
        root = min(src_ranks)
        buf = full if rt.rank == root else torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(buf, src=root, group=group)
        full = buf
    if rt.rank not in dst_ranks:
        return _empty(dst, placements, shape, dtype, device)
    out = DTensor.from_local(full, dst, (Replicate(),) * dst.ndim, run_check=False)
    return out.redistribute(dst, placements) if tuple(placements) != out.placements else out


def build_layouts(rt: Runtime, configs: Iterable[Config]) -> None:
    """Make every device mesh and transfer group a :class:`~flexsearch.emit.sharded.ShardedModule` over ``configs``
    on ``rt`` can use: the block mesh of each configuration (and of an op without one),
    the whole-runtime mesh outputs are gathered on, and one group per pair of those meshes
    (a :class:`_Move` between them broadcasts over the union of their ranks).

    ``DeviceMesh`` and ``new_group`` are collective over the default group and name
    groups by a counter, so every rank must make the same groups in the same order, also
    those it is not in. A module whose forward runs on only some ranks (a stage of a
    hybrid plan) must therefore not make them lazily: the caller runs this on every rank,
    for every stage, before any forward."""
    blocks = sorted({(0, len(rt.ranks), 1), (0, 1, 1)} | {(c.first, c.s, c.t) for c in configs})
    for b in blocks:
        rt.block_mesh(*b)
    for (f1, s1, t1), (f2, s2, t2) in itertools.combinations(blocks, 2):
        rt.subgroup(tuple(rt.ranks[d] for d in {*range(f1, f1 + s1 * t1), *range(f2, f2 + s2 * t2)}))


class _Move(torch.autograd.Function):
    """A tensor from one device mesh to another (forward: gather + broadcast to the new
    block; backward: the gradient the same way back)."""

    @staticmethod
    def forward(ctx, x: DTensor, dst, placements, rt: Runtime) -> DTensor:  # type: ignore[override]
        ctx.rt, ctx.src = rt, x.device_mesh
        ctx.src_placements = tuple(Replicate() if isinstance(p, Partial) else p for p in x.placements)
        return _transfer(rt, x, dst, placements)

    @staticmethod
    def backward(ctx, grad: DTensor):  # type: ignore[override]
        return _transfer(ctx.rt, grad, ctx.src, ctx.src_placements), None, None, None


class Whole(torch.autograd.Function):
    """A DTensor replicated on every rank -> the plain tensor (its gradient comes back
    dense, as every rank computed it)."""

    @staticmethod
    def forward(ctx, x: DTensor) -> torch.Tensor:  # type: ignore[override]
        ctx.mesh, ctx.shape = x.device_mesh, x.shape
        return x.to_local().contiguous()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return DTensor.from_local(grad.contiguous(), ctx.mesh, REPLICATE, run_check=False, shape=ctx.shape,
                                  stride=grad.contiguous().stride())


class Anchor(torch.autograd.Function):
    """A zero that depends on a DTensor this rank holds no data of: outputs built on it
    keep the tensor in the backward pass (its gradient is empty here)."""

    @staticmethod
    def forward(ctx, x: DTensor) -> torch.Tensor:  # type: ignore[override]
        ctx.spec = (x.device_mesh, x.placements, tuple(x.shape), x.dtype, x.to_local().device)
        return torch.zeros((), device=ctx.spec[4])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return _empty(*ctx.spec)


def to_layout(rt: Runtime, x: Any, mesh, placements) -> Any:
    """``x`` (a DTensor anywhere, or a plain tensor every rank holds) as a DTensor on
    ``mesh`` with ``placements``; other values unchanged."""
    if isinstance(x, DTensor):
        if x.device_mesh == mesh:
            return x if x.placements == tuple(placements) else x.redistribute(mesh, placements)
        return _Move.apply(x, mesh, tuple(placements), rt)
    if isinstance(x, torch.Tensor):
        if mesh.get_coordinate() is None:
            return _empty(mesh, placements, tuple(x.shape), x.dtype, x.device)
        d = DTensor.from_local(x, mesh, (Replicate(),) * mesh.ndim, run_check=False)
        return d.redistribute(mesh, placements) if tuple(placements) != d.placements else d
    return x


# ----------------------------------------------------------------------------- the module


def _reduced(grad: Any) -> Any:
    if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
        return grad.redistribute(grad.device_mesh, [Replicate() if p.is_partial() else p for p in grad.placements])
    return grad


def whole_grad(x: Any) -> Any:
    """``x`` unchanged; a partial-sum gradient of it all-reduced when it arrives (a
    tensor hook). On the output of an op replicated over its tensor-parallel group: its
    readers split (the q, k and v projections of a normalised input) hand back partial
    sums, which the op's own backward could carry on as ``Partial`` when it is linear in
    its gradient (a decomposed RMSNorm: DTensor would reduce the sums only at the next
    op that needs them whole, or reduce a parameter's gradient in their place, the
    embedding's); the simulation reduces them once at this op, as Megatron's ``f``
    operator does (:func:`flexsearch.sim.gradients.merged_reductions`)."""
    if isinstance(x, DTensor) and x.requires_grad and x.grad_fn is not None:
        x.register_hook(_reduced)
    return x
