"""Repeated blocks: find identical copies of a submodule (transformer layers, ResNet
bottlenecks) so that searches can share one decision per block.

Each module path ``p`` (every dotted prefix of a node's module path) is a candidate
block holding the nodes whose module path is ``p`` or lies under it. Two candidates are
copies when their node sequences have equal *signatures*: per node, the op's own
signature (target, configuration, shapes, constants) and its inputs written relative
to the block (``("in", k)`` for the block's k-th node, ``("ext", shape)`` for a value
from outside). Groups of at least two disjoint copies of at least two nodes are kept,
outermost first: a node belongs to at most one group.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence

from flexsearch.graph.opgraph import BlockGroup, BlockRef, OpNode


def _prefixes(path: str) -> list[str]:
    parts = path.split(".") if path else []
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def find_blocks(
    nodes: Sequence[OpNode],
    signature: Mapping[str, tuple],
    module_types: Mapping[str, str] | None = None,
) -> tuple[tuple[BlockGroup, ...], dict[str, BlockRef]]:
    """The groups of identical blocks and, per node in one, its :class:`BlockRef`."""
    members: dict[str, list[OpNode]] = defaultdict(list)
    for n in nodes:
        if n.kind in ("input", "output"):
            continue
        for p in _prefixes(n.module):
            members[p].append(n)

    by_name = {n.name: n for n in nodes}
    candidates: dict[tuple, list[str]] = defaultdict(list)
    for path, group in members.items():
        if len(group) < 2:
            continue
        position = {n.name: k for k, n in enumerate(group)}
        sig = []
        for n in group:
            ins = tuple(
                ("in", position[i]) if i in position else ("ext", by_name[i].output_shapes[:1])
                for i in n.inputs
            )
            sig.append((signature.get(n.name), n.kind, n.output_shapes, ins))
        key = ((module_types or {}).get(path, ""), tuple(sig))
        candidates[key].append(path)

    # Outermost first (fewest dots), then largest blocks.
    ordered = sorted(
        ((key, paths) for key, paths in candidates.items() if len(paths) >= 2),
        key=lambda kp: (min(p.count(".") for p in kp[1]), -len(members[kp[1][0]])),
    )
    taken: set[str] = set()
    groups: list[BlockGroup] = []
    refs: dict[str, BlockRef] = {}
    for key, paths in ordered:
        free = [p for p in paths if not any(n.name in taken for n in members[p])]
        # Copies must not nest inside each other either.
        free = [p for p in free if not any(q != p and p.startswith(q + ".") for q in free)]
        if len(free) < 2:
            continue
        gid = len(groups)
        instances = tuple(tuple(n.name for n in members[p]) for p in free)
        groups.append(BlockGroup(id=gid, module_type=key[0], modules=tuple(free), instances=instances))
        for i, inst in enumerate(instances):
            for k, name in enumerate(inst):
                taken.add(name)
                refs[name] = BlockRef(group=gid, instance=i, position=k)
    return tuple(groups), refs
