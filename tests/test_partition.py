"""The PipeDream partitioner against brute force over every partition and replication."""

from __future__ import annotations

import functools
import itertools
import math
import random

import pytest

from flexsearch.search.partition import Chain, Level, Memory, Stage, partition, pipeline_time


def brute_force(chain: Chain, levels: list[Level], memory: Memory | None, replicate: bool) -> float:
    """min over every nested pipeline of the recurrence's value, by enumeration."""

    @functools.cache
    def best(k: int, i: int, j: int, rep: int) -> float:
        # A_k(i..j) on one level-k machine: min over sequences of stages covering i..j.
        level = levels[k]

        @functools.cache
        def seq(s: int, w: int) -> float:
            if s == j:
                return 0.0
            out = math.inf
            for e in range(s + 1, j + 1):
                for r in range(1, (w if replicate else 1) + 1):
                    weights = sum(chain.params[s:e])
                    if k == 0:
                        inner = sum(chain.compute[s:e])
                        if memory is not None:
                            wf, sf = memory.per_replica(rep * r)
                            stash = sum(chain.stash[s:e]) if chain.stash else 0.0
                            if weights * wf + stash * sf > memory.capacity:
                                continue
                    else:
                        inner = best(k - 1, s, e, rep * r)
                    t = max(inner / r, level.sync(weights, r))
                    if e < j:
                        t = max(t, level.cut(chain.cut_bytes[e]), seq(e, w - r) if w > r else math.inf)
                    out = min(out, t)
            return out

        return seq(i, level.workers)

    return best(len(levels) - 1, 0, chain.layers, 1)


def random_chain(rng: random.Random, n: int) -> Chain:
    return Chain(
        compute=tuple(rng.choice([0.0, rng.uniform(0.1, 10)]) for _ in range(n)),
        params=tuple(rng.choice([0.0, rng.uniform(0, 50)]) for _ in range(n)),
        cut_bytes=(0.0,) + tuple(rng.uniform(0, 30) for _ in range(n - 1)) + (0.0,),
        stash=tuple(rng.uniform(0, 20) for _ in range(n)),
    )


CASES = [(seed, shape) for seed in range(40) for shape in ([3], [2, 2], [4], [2, 3], [1, 3], [2, 1, 2])]


@pytest.mark.parametrize(("seed", "shape"), CASES)
def test_partition_equals_brute_force(seed, shape):
    rng = random.Random(seed * 31 + len(shape))
    chain = random_chain(rng, rng.randint(1, 6 if len(shape) < 3 else 4))
    levels = [Level(w, rng.uniform(1, 20), rng.choice([0.0, 0.05])) for w in shape]
    memory = None
    if seed % 3 == 0:
        memory = Memory(capacity=rng.uniform(40, 150), weight_factor=rng.choice([1.0, 4.0]),
                        in_flight=lambda r: max(1, 4 // r), weight_stashing=bool(seed % 2))
    replicate = seed % 5 != 4
    want = brute_force(chain, levels, memory, replicate)
    got = partition(chain, levels, memory=memory, replicate=replicate)
    if math.isinf(want):
        assert got is None
        return
    assert got is not None
    assert got.bottleneck_s == pytest.approx(want, rel=1e-9, abs=1e-12)
    assert got.bottleneck_s == pipeline_time(chain, levels, got.stages, memory=memory)
    # The flattened stages tile the chain and use each device at most once.
    flat = got.device_stages()
    covered = sorted((s.start, s.end) for s in flat)
    assert covered[0][0] == 0 and covered[-1][1] == chain.layers
    used = [d for s in flat for d in s.devices]
    assert len(used) == len(set(used)) <= math.prod(shape)
    if not replicate:
        assert all(s.replicas == 1 for s in got.stages)


def test_single_level_matches_hand_computed_example():
    # Two layers, heavy weights on the second: replicate the first, not the second.
    chain = Chain(compute=(8.0, 2.0), params=(0.0, 100.0), cut_bytes=(0.0, 1.0, 0.0))
    got = partition(chain, [Level(4, bandwidth=10.0)])
    assert got is not None
    assert got.text() == "3-1"  # 8/3 on three replicas, 2 on one; sync of 100 bytes would cost 15
    assert got.bottleneck_s == pytest.approx(8 / 3)


def test_memory_infeasible_returns_none():
    chain = Chain(compute=(1.0,), params=(10.0,), cut_bytes=(0.0, 0.0))
    assert partition(chain, [Level(2, 1.0)], memory=Memory(capacity=5.0, weight_factor=1.0)) is None


def test_frozen_weights_are_held_once():
    """Two layers of 100 frozen bytes each fit one device of 250 bytes: held once, no
    gradient or optimizer state (counted as training, Adam's four copies, they need
    four devices' worth); the search and the definition agree."""
    mem = Memory(capacity=250.0, weight_factor=4.0)
    frozen = Chain(compute=(1.0, 1.0), params=(0.0, 0.0), cut_bytes=(0.0, 1e9, 0.0), frozen=(100.0, 100.0))
    trained = Chain(compute=(1.0, 1.0), params=(100.0, 100.0), cut_bytes=(0.0, 1e9, 0.0))
    one = [Level(1, 1e9, 0.0)]
    assert partition(frozen, one, memory=mem) is not None
    assert partition(trained, one, memory=mem) is None
    assert pipeline_time(frozen, one, (Stage(0, 2, 1),), memory=mem) == 2.0
    assert pipeline_time(frozen, one, (Stage(0, 2, 1),), memory=Memory(199.0, 4.0)) == math.inf
    with pytest.raises(ValueError, match="frozen"):
        Chain(compute=(1.0,), params=(0.0,), cut_bytes=(0.0, 0.0), frozen=(1.0, 2.0))


def test_nested_pipeline_time_reads_the_definition():
    chain = Chain(compute=(4.0, 4.0), params=(0.0, 0.0), cut_bytes=(0.0, 10.0, 0.0))
    levels = [Level(2, bandwidth=10.0), Level(2, bandwidth=1.0)]
    inner = (Stage(0, 1, 1), Stage(1, 2, 1))
    # Inner pipeline within a machine: max(4, 4, cut 2*10/10) = 4; two machines replicate it.
    assert pipeline_time(chain, levels, (Stage(0, 2, 2, inner),)) == pytest.approx(2.0)


@pytest.mark.parametrize("seed", range(40))
def test_straight_walk_equals_reach_arrays(seed):
    """One level, no replication: the scalar walk of ``_Solver._straight`` answers
    exactly what the reach arrays answer, at every bottleneck (memory or not)."""
    from flexsearch.search.partition import _Solver

    rng = random.Random(seed)
    n = rng.randint(1, 60)
    chain = Chain(compute=tuple(rng.uniform(0, 5) for _ in range(n)), params=tuple(rng.uniform(0, 5) for _ in range(n)),
                  cut_bytes=(0.0,) + tuple(rng.uniform(0, 20) for _ in range(n - 1)) + (0.0,),
                  stash=tuple(rng.uniform(0, 3) for _ in range(n)))
    level = Level(rng.randint(1, 12), rng.uniform(1, 10), rng.choice([0.0, 0.1]))
    memory = Memory(rng.uniform(5, 60), 2.0, in_flight=lambda r: 2) if seed % 2 else None
    solver = _Solver(chain, [level], memory, False)
    for x in [rng.uniform(0, 40) for _ in range(30)] + [float("inf")]:
        solver._info.clear()
        assert solver._straight(x) == bool(solver.reach(0, x, 1)[0] >= n), x


@pytest.mark.parametrize(("field", "bad"), [("compute", -1.0), ("compute", math.nan), ("params", math.inf),
                                            ("stash", -0.5), ("frozen", math.nan)])
def test_a_chain_refuses_negative_or_infinite_layers(field, bad):
    good = {"compute": (1.0, 2.0), "params": (3.0, 4.0), "stash": (0.0, 1.0), "frozen": (0.0, 0.0)}
    with pytest.raises(ValueError, match=f"chain {field} must be finite and >= 0"):
        Chain(**{**good, field: (1.0, bad)}, cut_bytes=(0.0, 1.0, 0.0))
    for cuts in ((0.0, -1.0, 0.0), (0.0, math.nan, 0.0)):
        with pytest.raises(ValueError, match="cut_bytes must be >= 0"):
            Chain(**good, cut_bytes=cuts)
    assert Chain(**good, cut_bytes=(0.0, math.inf, 0.0)).layers == 2  # infinite: no cut there


def test_a_chain_s_prefix_sums_are_computed_once_and_read_only():
    rng = random.Random(3)
    chain = Chain(tuple(rng.random() for _ in range(50)), tuple(rng.random() for _ in range(50)),
                  tuple(rng.random() for _ in range(51)), stash=tuple(rng.random() for _ in range(50)))
    c, w, s, f = chain.prefix_sums
    for pre, values in ((c, chain.compute), (w, chain.params), (s, chain.stash), (f, (0.0,) * 50)):
        assert pre[0] == 0.0 and list(pre[1:]) == list(itertools.accumulate(values))
        assert not pre.flags.writeable
    assert chain.prefix_sums is chain.prefix_sums and not chain.cut_array.flags.writeable
