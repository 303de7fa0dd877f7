"""A training step's inputs and loss, as users call their models.

Example inputs are a tuple of positional arguments, with an optional trailing ``dict``
of keyword arguments (``decoder_input_ids``, ``attention_mask``, ``labels``,
``targets``): the model-file convention. Dim 0 of every tensor, keyword ones included,
is the batch.

A model that computes its own loss (Hugging Face models given ``labels``, a GPT given
``targets``) returns it in its output: a ``loss`` field or key, or a 0-dim tensor in a
returned tuple (``(logits, loss)``), or the output itself when it is a 0-dim tensor.
:func:`model_loss` finds it, so ``train_step``
needs no ``loss_fn`` for such a model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_map

from flexsearch.errors import EmitError


def split(inputs: tuple) -> tuple[tuple, dict]:
    """``(args, kwargs)`` of example inputs (module docstring)."""
    if inputs and isinstance(inputs[-1], dict):
        return tuple(inputs[:-1]), dict(inputs[-1])
    return tuple(inputs), {}


def shard(inputs: tuple, index: int, parts: int) -> tuple:
    """Slice ``index`` of ``parts`` of every tensor input along the batch, keyword ones
    included (the same structure back)."""
    from flexsearch.emit.data import batch_shard

    return tree_map(lambda x: batch_shard(x, index, parts), inputs)


def call(model: Callable, inputs: tuple) -> Any:
    args, kwargs = split(inputs)
    return model(*args, **kwargs)


def model_loss(out: Any) -> torch.Tensor:
    """The loss a model returned (module docstring); EmitError when there is none."""
    if isinstance(out, torch.Tensor) and out.dim() == 0:  # ``return F.cross_entropy(...)``
        return out
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, dict):
        loss = out.get("loss")
    if loss is None and isinstance(out, (tuple, list)):
        loss = next((t for t in out if isinstance(t, torch.Tensor) and t.dim() == 0), None)
    if not isinstance(loss, torch.Tensor):
        raise EmitError("the model returned no loss (no `loss` field, no 0-dim tensor in its output); pass its "
                        "labels or targets among the inputs, or give train_step a loss_fn")
    return loss


def step_loss(out: Any, target: Any, loss_fn: Callable[[Any, Any], torch.Tensor] | None) -> torch.Tensor:
    """``loss_fn(out, target)``, or the model's own loss when ``loss_fn`` is None."""
    return model_loss(out) if loss_fn is None else loss_fn(out, target)


def main_output(out: Any) -> torch.Tensor:
    """The tensor a model's output is about: ``logits``, else ``last_hidden_state``, else
    the first tensor in it."""
    for key in ("logits", "last_hidden_state"):
        t = out.get(key) if isinstance(out, dict) else getattr(out, key, None)
        if isinstance(t, torch.Tensor):
            return t
    if isinstance(out, torch.Tensor):
        return out
    from torch.utils._pytree import tree_flatten

    first = next((t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)), None)
    if first is None:
        raise EmitError("the model's output holds no tensor")
    return first


def default_objective(model: Any, inputs: tuple) -> tuple[Any, Any]:
    """``(target, loss_fn)`` to train ``model`` on: ``(None, None)`` (its own loss) when
    it returns one, else a mean-squared loss of its main output against a fixed random
    target (seed 0) of that output's shape."""
    with torch.no_grad():
        out = call(model, inputs)
    try:
        model_loss(out)
        return None, None
    except EmitError:
        pass
    shape = main_output(out).shape
    target = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    return target, mse_main


def mse_main(out: Any, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(main_output(out).float(), target)
