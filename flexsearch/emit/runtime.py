"""What every emitted plan shares at run time: the process group, the device -> rank
map, device meshes for configuration blocks, and process groups for transfers.

Device ``i`` of a plan is rank ``i`` of the process group (``group`` or the default
group). Every rank builds the same meshes and groups in the same order (torch's
``new_group`` is collective over the default group), so they are made lazily but only
from code that every rank runs identically.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from flexsearch.errors import EmitError
from flexsearch.plan import Plan
from flexsearch.precision import precision as precision_of


def device_type() -> str:
    """``cuda`` when torch.distributed runs NCCL on GPUs here, else ``cpu`` (gloo)."""
    if dist.is_initialized() and dist.get_backend() == "nccl" and torch.cuda.is_available():
        return "cuda"
    return "cpu"


class Runtime:
    """The process group of one emitted plan and the meshes/groups built on it."""

    def __init__(self, plan: Plan, group: dist.ProcessGroup | None = None):
        if not dist.is_available() or not dist.is_initialized():
            raise EmitError(
                "torch.distributed is not initialized; start the script with torchrun and call "
                "torch.distributed.init_process_group() before flexsearch.parallelize()"
            )
        self.group = group if group is not None else dist.group.WORLD
        self.ranks: tuple[int, ...] = tuple(dist.get_process_group_ranks(self.group))
        if len(self.ranks) != plan.devices:
            raise EmitError(
                f"the plan is for {plan.devices} devices but the process group has {len(self.ranks)} "
                f"ranks; launch with --nproc-per-node {plan.devices} (or plan again with "
                f"--devices {len(self.ranks)})"
            )
        self.rank = dist.get_rank()
        if self.rank not in self.ranks:
            raise EmitError(f"rank {self.rank} is not in the process group given to parallelize()")
        self.device = self.ranks.index(self.rank)
        """This rank's device index in the plan."""
        self.device_type = device_type()
        self.precision = precision_of(plan.precision)
        """The plan's training precision (:mod:`flexsearch.emit.precision` applies it)."""
        self._meshes: dict[tuple, DeviceMesh] = {}
        self._groups: dict[tuple[int, ...], dist.ProcessGroup | None] = {}

    @property
    def local_device(self) -> torch.device:
        """This rank's device: its GPU under NCCL (where its collectives' tensors live), else the CPU."""
        return torch.device("cuda", torch.cuda.current_device()) if self.device_type == "cuda" else torch.device("cpu")

    def sub(self, devices: list[int]) -> Runtime:
        """A runtime over some of this one's devices (device ``i`` of the sub-runtime is
        ``devices[i]``), sharing the mesh and group caches."""
        out = object.__new__(Runtime)
        out.__dict__.update(self.__dict__)
        out.ranks = tuple(self.ranks[d] for d in devices)
        out.device = out.ranks.index(self.rank) if self.rank in out.ranks else -1
        out.group = None
        return out

    def mesh(self, devices: list, names: tuple[str, ...] = ("s", "t")) -> DeviceMesh:
        """The device mesh of this runtime's devices laid out as ``devices`` (nested lists)."""
        ranks, key = self._mesh_key(devices, names)
        if key not in self._meshes:
            self._meshes[key] = DeviceMesh(self.device_type, torch.tensor(ranks), mesh_dim_names=names)
        return self._meshes[key]

    def _mesh_key(self, devices: list, names: tuple[str, ...]) -> tuple[list, tuple]:
        """``devices`` as global ranks (the same nesting), and the mesh cache's key."""
        def ranks_of(x):
            return [ranks_of(y) for y in x] if isinstance(x, (list, tuple)) else self.ranks[x]

        ranks = ranks_of(devices)
        return ranks, (repr(ranks), names)

    def block_mesh(self, first: int, s: int, t: int) -> DeviceMesh:
        """The ``s x t`` mesh of devices ``first .. first + s*t - 1`` (``t`` innermost)."""
        return self.mesh(_block(first, s, t))

    def adopt_block(self, first: int, s: int, t: int, mesh: DeviceMesh) -> None:
        """Use ``mesh`` (made over the same ranks in the same layout, as a slice of a
        larger mesh) as the block mesh of ``(first, s, t)`` on this rank from now on.
        The block's own mesh must already be made (on every rank, in the same order:
        the groups it made stay)."""
        ranks, key = self._mesh_key(_block(first, s, t), ("s", "t"))
        if mesh.mesh.tolist() != ranks:
            raise EmitError(f"a mesh over {mesh.mesh.tolist()} cannot stand for the block over {ranks}")
        self._meshes[key] = mesh

    def subgroup(self, ranks: tuple[int, ...]) -> dist.ProcessGroup | None:
        """A process group over global ``ranks`` (sorted), made once; None when this rank
        is not in it."""
        key = tuple(sorted(set(ranks)))
        if key not in self._groups:
            if key == tuple(range(dist.get_world_size())):
                self._groups[key] = dist.group.WORLD
            else:
                g = dist.new_group(list(key), use_local_synchronization=False)
                self._groups[key] = g if self.rank in key else None
        return self._groups[key]


def _block(first: int, s: int, t: int) -> list[list[int]]:
    """The devices of block ``(first, s, t)``: ``s`` rows of ``t``."""
    return [[first + i * t + j for j in range(t)] for i in range(s)]
