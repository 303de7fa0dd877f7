"""Checkpoints of emitted modules, readable by the original model and the reverse.

**Format.** A directory written by ``torch.distributed.checkpoint`` (DCP) with its
default file-system layout: ``.metadata`` (every tensor's global shape, dtype and the
chunks that hold it) and one ``__<rank>_0.distcp`` file per writing rank. The keys are
the *original* model's state-dict keys (``model.state_dict()`` of the unparallelized
model: parameters and persistent buffers) and every tensor is stored whole in global
shape, cut into the chunks the writing ranks held. Optimizer state is not saved.

So a checkpoint is independent of the plan that wrote it: one written by any emitted
module (:func:`save`, every rank of the job) loads into a module emitted for another
plan or world size (:func:`load` reshards), and into the plain single-process model
(:func:`load_original`); one written from the plain model (:func:`save_original`)
loads into any emitted module.

**Which tensors each kind writes** (the state dict of an emitted module, under the
original keys):

- a module with ``original_state_dict()``: that dict; its values must alias the
  module's tensors (as ``state_dict()`` values do: DCP loads in place), and a rank may
  hold a subset of the keys; else a module with ``stage_modules()`` (pipeline/hybrid):
  the union of its stage modules' state dicts (a :class:`ShardedModule` stage by its
  ``module``), each keyed by original names, this rank's stages only;
- ``decentralized``: the model every rank keeps; :func:`save` first averages the ranks'
  parameters (``average_parameters(inplace=True)``, a collective: every rank continues
  from the average, as D-PSGD evaluates), so the checkpoint holds the average
  parameters; buffers (BatchNorm statistics) are not averaged and one rank's are
  written; :func:`load` gives every rank the same model;
- ``data``: the inner model's ``state_dict()``: plain tensors for DDP, every rank the
  same (DCP writes each key once), ``Shard(0)`` DTensors for FSDP2;
- ``soap``: ``ShardedModule.module.state_dict()``: DTensors on the mesh of each
  parameter's first user. A DTensor on a sub-mesh that does not include this rank
  (an op placed on another block of devices) holds an empty local shard there; DCP's
  default planners skip a DTensor on a rank whose ``device_mesh.get_coordinate()`` is
  None, both when saving (the ranks of its mesh write it) and when loading (nothing is
  read there), so these entries go to DCP as they are, with no conversion.

Errors a user can cause (no checkpoint directory, keys or shapes that are not those of
this model) are :class:`~flexsearch.errors.EmitError`, raised on every rank alike
before any tensor is read.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from flexsearch.errors import EmitError

_NO_DIST_WARNING = r"torch\.distributed is (disabled, )?(unavailable|uninitialized)"


def state_dict_of(module: nn.Module) -> dict[str, Any]:
    """The state dict of an emitted module under the original model's keys (see the
    module docstring); a plain model's own ``state_dict()``."""
    from flexsearch.emit.data import DataParallelModule
    from flexsearch.emit.decentralized import DecentralizedModule
    from flexsearch.emit.sharded import ShardedModule

    if callable(getattr(module, "original_state_dict", None)):
        return dict(module.original_state_dict())  # type: ignore[operator]
    if isinstance(module, (DataParallelModule, DecentralizedModule)):
        return module.model.state_dict()
    if isinstance(module, ShardedModule):
        return module.module.state_dict()
    if callable(getattr(module, "stage_modules", None)):
        out: dict[str, Any] = {}
        for m in module.stage_modules():  # type: ignore[operator]
            out.update((m.module if isinstance(m, ShardedModule) else m).state_dict())
        return out
    if isinstance(module, nn.parallel.DistributedDataParallel):
        return module.module.state_dict()
    if callable(getattr(module, "train_step", None)):
        raise EmitError(f"cannot checkpoint a {type(module).__name__}: it exposes neither "
                        "original_state_dict() nor stage_modules(); save the original model instead")
    return module.state_dict()


def _group(module: nn.Module, group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    if group is not None:
        return group
    rt = getattr(module, "_rt", None)
    return getattr(rt, "group", None)


def _writable(path: str | os.PathLike[str]) -> Path:
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise EmitError(f"checkpoint path {p} is a file, not a directory; pass a directory to write into")
    return p


def _metadata(path: str | os.PathLike[str]) -> Metadata:
    p = Path(path)
    if not p.is_dir():
        raise EmitError(f"checkpoint directory {p} does not exist; pass the directory a "
                        "flexsearch checkpoint was saved to")
    if not (p / ".metadata").is_file():
        raise EmitError(f"{p} is not a checkpoint (no .metadata file); pass the directory a "
                        "flexsearch checkpoint was saved to")
    try:
        return FileSystemReader(str(p)).read_metadata()
    except Exception as e:  # noqa: BLE001 - any unreadable metadata is the same user error
        raise EmitError(f"cannot read checkpoint {p} ({type(e).__name__}: {e}); "
                        "save the checkpoint again") from None


def _shapes(state: Mapping[str, Any]) -> dict[str, tuple[int, ...] | None]:
    """Key -> global shape (None for non-tensor values)."""
    return {k: tuple(v.shape) if isinstance(v, torch.Tensor) else None for k, v in state.items()}


def _all_shapes(shapes: dict[str, tuple[int, ...] | None],
                group: dist.ProcessGroup | None) -> dict[str, tuple[int, ...] | None]:
    """The union of every rank's ``shapes`` (ranks of a pipeline hold subsets)."""
    if not (dist.is_available() and dist.is_initialized()):
        return shapes
    n = dist.get_world_size(group)
    if n == 1:
        return shapes
    every: list[Any] = [None] * n
    dist.all_gather_object(every, shapes, group=group)
    out: dict[str, tuple[int, ...] | None] = {}
    for s in every:
        out.update(s)
    return out


def _check(path: str | os.PathLike[str], md: Metadata, shapes: Mapping[str, tuple[int, ...] | None]) -> None:
    """EmitError unless the checkpoint holds exactly the keys and shapes of ``shapes``."""
    saved = md.state_dict_metadata
    missing = sorted(set(shapes) - set(saved))
    extra = sorted(set(saved) - set(shapes))
    if missing or extra:
        what = []
        if missing:
            what.append(f"lacks {len(missing)} key(s) of this model ({', '.join(missing[:3])}"
                        f"{', ...' if len(missing) > 3 else ''})")
        if extra:
            what.append(f"has {len(extra)} key(s) this model does not ({', '.join(extra[:3])}"
                        f"{', ...' if len(extra) > 3 else ''})")
        raise EmitError(f"checkpoint {path} {' and '.join(what)}: it was saved from another model; "
                        "load it into the model it was saved from")
    for k in sorted(shapes):
        s, m = shapes[k], saved[k]
        if s is not None and isinstance(m, TensorStorageMetadata) and tuple(m.size) != s:
            raise EmitError(f"checkpoint {path} holds {k} of shape {tuple(m.size)}, but this model's is "
                            f"{s}: it was saved from another model configuration; load it into the "
                            "model it was saved from")
        if (s is None) != (not isinstance(m, TensorStorageMetadata)):
            raise EmitError(f"checkpoint {path} holds {k} as "
                            f"{'a tensor' if s is None else 'a non-tensor value'}, unlike this model; "
                            "load it into the model it was saved from")


def save(module: nn.Module, path: str | os.PathLike[str], *, group: dist.ProcessGroup | None = None) -> None:
    """Write ``module`` (an emitted module; every rank of its process group calls this)
    to the checkpoint directory ``path`` (created; files of the same name replaced).

    ``group``: the process group (default: the one the module was emitted on)."""
    p = _writable(path)
    if callable(getattr(module, "average_parameters", None)):  # D-PSGD: save the average model
        module.average_parameters(inplace=True)  # type: ignore[operator]
    state = state_dict_of(module)
    dcp.save(state, storage_writer=FileSystemWriter(str(p)), process_group=_group(module, group))


def load(module: nn.Module, path: str | os.PathLike[str], *, group: dist.ProcessGroup | None = None) -> None:
    """Read the checkpoint directory ``path`` into ``module`` (an emitted module; every
    rank of its process group calls this), in place, resharding to the module's layout."""
    md = _metadata(path)
    state = state_dict_of(module)
    g = _group(module, group)
    _check(path, md, _all_shapes(_shapes(state), g))
    with torch.no_grad():
        dcp.load(state, storage_reader=FileSystemReader(str(path)), process_group=g)


def save_original(model: nn.Module, path: str | os.PathLike[str]) -> None:
    """Write the plain (unparallelized) ``model`` to the checkpoint directory ``path``,
    from one process (no process group needed; with one, call it on one rank only)."""
    p = _writable(path)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NO_DIST_WARNING)
        dcp.save(model.state_dict(), storage_writer=FileSystemWriter(str(p)), no_dist=True)


def load_original(model: nn.Module, path: str | os.PathLike[str]) -> None:
    """Read the checkpoint directory ``path`` (written by :func:`save` or
    :func:`save_original`) into the plain ``model``, in one process."""
    md = _metadata(path)
    state = model.state_dict()
    _check(path, md, _shapes(state))
    with warnings.catch_warnings(), torch.no_grad():
        warnings.filterwarnings("ignore", message=_NO_DIST_WARNING)
        dcp.load(state, storage_reader=FileSystemReader(str(path)), no_dist=True)
    model.load_state_dict(state)


__all__ = ["load", "load_original", "save", "save_original", "state_dict_of"]
