"""Does an emitted module compute what the original model did?

:func:`verify` runs on every rank of a process group: one training step of the emitted
module against a single-process reference (the original model on the whole batch),
then ``steps`` optimizer steps of both. Losses, every gradient and every parameter are
compared with ``torch.testing.assert_close`` (float32 tolerances). Tests and the
fidelity benchmark use it; ``flexsearch`` users can run it before a long job.

Decentralized (D-PSGD) plans compute something else on purpose: every rank keeps its
own model. From identical models, one step still has exact references: the mean over
ranks of the local gradients is the reference gradient, and the mean of the ranks'
models after the optimizer step is the reference model after one SGD step (mixing
identical models changes nothing; the mean of ``x - lr g_i`` is ``x - lr mean g_i``).
Later steps take gradients at different models, so only that first step is compared.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from flexsearch.plan import Plan


def full(t: torch.Tensor | None) -> torch.Tensor | None:
    """The whole tensor on this rank (gathered when distributed; None for ranks outside
    its mesh, which hold nothing)."""
    if isinstance(t, DTensor):
        f = t.full_tensor()
        return None if t.device_mesh.get_coordinate() is None else f
    return t


def original_parameters(module: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's parameters of an emitted module under their names in the original model."""
    return dict(module.named_original_parameters())  # type: ignore[operator]


def verify(model: nn.Module, plan: Plan, inputs: tuple, target: Any,
           loss_fn: Callable[[Any, Any], torch.Tensor], *, steps: int = 3, lr: float = 0.05,
           group=None, rtol: float = 1e-4, atol: float = 1e-5) -> dict[str, Any]:
    """Emit ``plan`` for ``model`` and compare it with the original on this rank.

    Raises AssertionError (naming the tensor) on the first mismatch; returns what was
    checked: ``loss``, ``reference_loss``, ``params`` (names this rank holds)."""
    import torch.distributed as dist

    from flexsearch.emit import parallelize

    ref = copy.deepcopy(model)
    emitted = parallelize(model, plan, group=group)
    decentralized = plan.kind == "decentralized"
    loss = emitted.train_step(inputs, target, loss_fn)
    ref_loss = loss_fn(ref(*inputs), target)
    ref_loss.backward()
    torch.testing.assert_close(loss.float(), ref_loss.detach().float(), rtol=rtol, atol=atol,
                               msg=lambda m: f"loss differs: {m}")
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    mine = original_parameters(emitted)
    unknown = sorted(set(mine) - set(ref_params))
    if unknown:
        raise AssertionError(f"emitted parameters not in the original model: {unknown[:5]}")
    for name in sorted(mine):
        g = full(mine[name].grad)
        if decentralized and g is not None:  # local gradients: their mean is the reference
            g = g.clone()
            dist.all_reduce(g, group=group)
            g /= dist.get_world_size(group)
        if g is None and mine[name].grad is None and ref_params[name].grad is None:
            continue
        if g is None and isinstance(mine[name], DTensor) and mine[name].device_mesh.get_coordinate() is None:
            continue
        torch.testing.assert_close(g, ref_params[name].grad, rtol=rtol, atol=atol,
                                   msg=lambda m, name=name: f"gradient of {name} differs: {m}")
    opt = torch.optim.SGD([p for p in emitted.parameters() if p.requires_grad], lr=lr)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr)
    opt.step()
    ref_opt.step()
    if decentralized:
        avg = emitted.average_parameters()
        for name in sorted(mine):
            torch.testing.assert_close(avg[name], ref_params[name].detach(), rtol=rtol * 10, atol=atol * 10,
                                       msg=lambda m, name=name: f"mean of the ranks' {name} differs after one "
                                                                f"step: {m}")
        return {"loss": float(loss), "reference_loss": float(ref_loss.detach()), "params": sorted(mine)}
    for _ in range(steps - 1):
        opt.zero_grad()
        ref_opt.zero_grad()
        emitted.train_step(inputs, target, loss_fn)
        loss_fn(ref(*inputs), target).backward()
        opt.step()
        ref_opt.step()
    for name in sorted(mine):
        p = full(mine[name].detach())
        if p is None:
            continue
        torch.testing.assert_close(p, ref_params[name].detach(), rtol=rtol * 10, atol=atol * 10,
                                   msg=lambda m, name=name: f"parameter {name} differs after {steps} steps: {m}")
    return {"loss": float(loss), "reference_loss": float(ref_loss.detach()), "params": sorted(mine)}
