"""Region lookups: :class:`TileIndex` finds what a scan with ``intersect`` finds."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from flexsearch.graph.regions import TileIndex, intersect, split_interval


@st.composite
def tilings(draw):
    """The tiles of a block partition of a 1-3 dim tensor (each dim split into equal
    pieces, or left whole and the tile replicated), in a shuffled order, or arbitrary
    boxes (some of zero width, some overlapping)."""
    dims = draw(st.integers(1, 3))
    shape = [draw(st.sampled_from([1, 4, 6, 12, 16])) for _ in range(dims)]
    if draw(st.booleans()):
        splits = [draw(st.sampled_from([p for p in (1, 2, 3, 4, 6, 12, 16) if size % p == 0])) for size in shape]
        tiles = [tuple(split_interval(size, p, i) for size, p, i in zip(shape, splits, idx, strict=True))
                 for idx in itertools.product(*(range(p) for p in splits))]
        tiles = draw(st.permutations(tiles))
    else:
        def box():
            out = []
            for size in shape:
                lo = draw(st.integers(0, size))
                out.append((lo, draw(st.integers(lo, size))))
            return tuple(out)

        tiles = list(dict.fromkeys(box() for _ in range(draw(st.integers(1, 8)))))
    needs = []
    for _ in range(draw(st.integers(1, 6))):
        need = []
        for size in shape:
            lo = draw(st.integers(0, size))
            need.append((lo, draw(st.integers(lo, size))))
        needs.append(tuple(need))
    return tiles, needs


@settings(max_examples=300, derandomize=True, deadline=None, database=None)
@given(tilings())
def test_the_tile_index_finds_what_a_scan_finds(case):
    tiles, needs = case
    index = TileIndex(tiles)
    for need in needs:
        assert index.overlapping(need) == [r for r in tiles if intersect(need, r) is not None]


def test_a_block_partition_is_indexed_and_overlapping_boxes_are_scanned():
    grid = [(split_interval(256, 256, i), (0, 8)) for i in range(256)]
    assert TileIndex(grid).dims is not None
    assert TileIndex(grid).overlapping(((10, 12), (0, 8))) == grid[10:12]
    assert TileIndex([((0, 4),), ((2, 6),)]).dims is None
