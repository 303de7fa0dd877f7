"""Gossip topologies: mixing matrices, spectral gaps, neighbour lists, errors, and the
time-to-accuracy factor (flexsearch.strategy.topology)."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

from flexsearch.errors import FlexsearchError, TopologyError
from flexsearch.strategy import topology as topology_module
from flexsearch.strategy.topology import (
    TOPOLOGIES,
    Topology,
    build,
    exact_gap,
    iteration_bound,
    iterations_factor,
    mixing_parameters,
    torus_shape,
)

POWERS = [8, 16, 32, 64, 128, 256, 512, 1024]
SMALL = [1, 2, 3, 4, 5, 6, 8, 9, 12, 16, 18, 25, 32, 64]


def _custom_edges(n: int, seed: int = 0) -> list[tuple[int, int]]:
    """A random connected graph: a random spanning tree plus a few extra edges."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(n)
    edges = [(int(order[k]), int(order[rng.integers(k)])) for k in range(1, n)]
    edges += [(int(a), int(b)) for a, b in rng.integers(n, size=(n // 2, 2)) if a != b]
    return edges


def _topology(name: str, n: int) -> Topology | None:
    if name == "torus" and n > 1 and all(n % r for r in range(2, math.isqrt(n) + 1)):
        return None  # prime: no torus
    if name == "one_peer_exponential" and n & (n - 1):
        return None
    if name == "custom":
        return build("custom", n, edges=_custom_edges(n))
    return build(name, n)


def _product(topology: Topology, start: int, steps: int) -> np.ndarray:
    """W_{start+steps-1} ... W_start, multiplying by the (sparse) W_t row by row."""
    n = topology.n
    out = np.eye(n)
    for t in range(start, start + steps):
        w = topology.matrix(t)
        rows, cols = np.nonzero(w)
        new = np.zeros_like(out)
        np.add.at(new, rows, w[rows, cols][:, None] * out[cols])
        out = new
    return out


# --- matrices --------------------------------------------------------------------------

@pytest.mark.parametrize("name", TOPOLOGIES)
@pytest.mark.parametrize("n", SMALL)
def test_matrices_doubly_stochastic(name, n):
    topology = _topology(name, n)
    if topology is None:
        pytest.skip(f"no {name} on {n} ranks")
    assert topology.n == n and topology.period >= 1
    for step in range(topology.period):
        w = topology.matrix(step)
        assert w.shape == (n, n) and w.dtype == np.float64
        assert w.min() >= 0.0
        np.testing.assert_allclose(w.sum(axis=1), 1.0, atol=1e-12)
        np.testing.assert_allclose(w.sum(axis=0), 1.0, atol=1e-12)
        if not topology.directed:
            np.testing.assert_array_equal(w, w.T)


def test_uniform_weights_and_degenerate_sizes():
    ring = build("ring", 8).matrix()
    assert ring[0, 0] == ring[0, 1] == ring[0, 7] == pytest.approx(1 / 3) and ring[0, 2] == 0
    torus = build("torus", 16).matrix()  # 4 x 4
    assert sorted(np.flatnonzero(torus[5])) == [1, 4, 5, 6, 9] and torus[5, 5] == pytest.approx(1 / 5)
    np.testing.assert_allclose(build("ring", 2).matrix(), np.full((2, 2), 0.5))
    np.testing.assert_allclose(build("ring", 3).matrix(), np.full((3, 3), 1 / 3))
    for name in ("ring", "torus", "exponential", "one_peer_exponential", "complete"):
        t = build(name, 1)
        np.testing.assert_array_equal(t.matrix(), [[1.0]])
        assert t.degree() == 0 and t.spectral_gap == 1.0 and t.in_neighbours(0) == ()
    expo = build("exponential", 8).matrix()
    assert expo[0, 0] == pytest.approx(1 / 4) and not np.allclose(expo, expo.T)
    np.testing.assert_allclose(build("complete", 5).matrix(), np.full((5, 5), 0.2))


@pytest.mark.parametrize("n, shape", [(1, (1, 1)), (4, (2, 2)), (8, (2, 4)), (9, (3, 3)),
                                      (12, (3, 4)), (16, (4, 4)), (18, (3, 6)), (32, (4, 8)),
                                      (36, (6, 6)), (1024, (32, 32)), (22, (2, 11))])
def test_torus_shape(n, shape):
    assert torus_shape(n) == shape


@pytest.mark.parametrize("n", [3, 5, 6, 7, 10, 12, 24, 100])
def test_exponential_not_power_of_two_is_doubly_stochastic(n):
    topology = build("exponential", n)
    k = math.ceil(math.log2(n))
    assert topology.degree() == k
    assert topology.out_neighbours(0) == tuple(sorted({(1 << j) % n for j in range(k)}))
    w = topology.matrix()
    np.testing.assert_allclose(w.sum(axis=0), 1.0, atol=1e-12)
    np.testing.assert_allclose(w.sum(axis=1), 1.0, atol=1e-12)


def test_matrices_cached_and_read_only():
    topology = build("one_peer_exponential", 1024)
    assert topology.matrix(3) is topology.matrix(3) is topology.matrix(13)
    assert topology.matrix(3) is not topology.matrix(4)
    with pytest.raises(ValueError):
        topology.matrix(0)[0, 0] = 1.0
    start = time.perf_counter()
    for step in range(100):
        topology.matrix(step)
    assert time.perf_counter() - start < 0.5
    assert build("ring", 8) == build("ring", 8) and len({build("ring", 8), build("ring", 8)}) == 1


# --- spectral gaps ---------------------------------------------------------------------

@pytest.mark.parametrize("n", POWERS)
@pytest.mark.parametrize("name", ["ring", "exponential"])
def test_gap_matches_closed_form(name, n):
    assert build(name, n).spectral_gap == pytest.approx(exact_gap(name, n), rel=0.01)


@pytest.mark.parametrize("n", [9, 16, 25, 36, 64, 100, 256, 1024])
def test_torus_gap_matches_closed_form(n):
    assert build("torus", n).spectral_gap == pytest.approx(exact_gap("torus", n), rel=0.01)


@pytest.mark.parametrize("name", TOPOLOGIES)
@pytest.mark.parametrize("n", [2, 4, 6, 8, 9, 12, 16, 20, 27, 32, 64])
def test_gap_against_dense_reference(name, n):
    """The FFT spectrum (and the custom eigvalsh) against numpy's dense spectral norm."""
    topology = _topology(name, n)
    if topology is None:
        pytest.skip(f"no {name} on {n} ranks")
    product = _product(topology, 0, topology.period) - 1.0 / n
    beta = np.linalg.norm(product, 2)
    beta = 0.0 if beta < 1e-12 else beta
    assert topology.spectral_gap == pytest.approx(1.0 - beta ** (1.0 / topology.period), abs=1e-9)
    p, tau = mixing_parameters(topology)
    assert tau == topology.period and p == pytest.approx(1.0 - beta**2, abs=1e-9)


def test_gap_special_values_and_speed():
    assert build("complete", 1024).spectral_gap == 1.0
    assert build("one_peer_exponential", 64).spectral_gap == 1.0
    assert exact_gap("ring", 2) == exact_gap("exponential", 2) == exact_gap("complete", 7) == 1.0
    big = [Topology(name, 1024, name in ("exponential", "one_peer_exponential"), period)
           for name, period in (("ring", 1), ("torus", 1), ("exponential", 1), ("one_peer_exponential", 10))]
    topology_module._contraction.cache_clear()
    start = time.perf_counter()
    gaps = [t.spectral_gap for t in big]  # FFT of the generator: no n x n matrix needed
    assert time.perf_counter() - start < 1.0
    assert gaps == pytest.approx([exact_gap("ring", 1024), exact_gap("torus", 1024), 2 / 11, 1.0])


# --- one-peer exponential ----------------------------------------------------------------

@pytest.mark.parametrize("n", [*POWERS[:-1], pytest.param(POWERS[-1], marks=pytest.mark.slow)])
def test_one_peer_product_is_exact_average(n):
    topology = build("one_peer_exponential", n)
    tau = int(math.log2(n))
    assert topology.period == tau and topology.directed and topology.degree(0) == 1
    offsets = range(tau) if n <= 64 else (0, 1, tau - 1, 2 * tau + 3)
    for start in offsets:
        np.testing.assert_allclose(_product(topology, start, tau), np.full((n, n), 1.0 / n),
                                   rtol=0, atol=1e-12)
    # one step short of a period is not an average yet
    assert not np.allclose(_product(topology, 0, tau - 1), 1.0 / n)


def test_one_peer_partners():
    topology = build("one_peer_exponential", 8)
    assert topology.in_neighbours(0, 0) == ((1, 0.5),) and topology.out_neighbours(0, 0) == (7,)
    assert topology.in_neighbours(0, 1) == ((2, 0.5),) and topology.out_neighbours(0, 1) == (6,)
    assert topology.in_neighbours(3, 2) == ((7, 0.5),) and topology.out_neighbours(3, 2) == (7,)
    assert topology.in_neighbours(0, 3) == topology.in_neighbours(0, 0)
    assert topology.self_weight(5, 4) == 0.5


# --- neighbours -----------------------------------------------------------------------

@pytest.mark.parametrize("name", TOPOLOGIES)
@pytest.mark.parametrize("n", [1, 2, 6, 8, 9, 12, 16, 25, 27])
def test_neighbours_match_matrix(name, n):
    """Neighbours, self weights and degrees (read off a circulant topology's generator)
    against the dense matrix."""
    topology = _topology(name, n)
    if topology is None:
        pytest.skip(f"no {name} on {n} ranks")
    for step in range(topology.period + 1):
        w = topology.matrix(step)
        out_degrees = []
        for rank in range(n):
            ins = topology.in_neighbours(rank, step)
            outs = topology.out_neighbours(rank, step)
            assert [j for j, _ in ins] == [j for j in range(n) if j != rank and w[rank, j] > 0]
            assert all(x == w[rank, j] for j, x in ins)
            assert list(outs) == [k for k in range(n) if k != rank and w[k, rank] > 0]
            assert topology.self_weight(rank, step) == w[rank, rank]
            assert topology.self_weight(rank, step) + sum(x for _, x in ins) == pytest.approx(1.0)
            out_degrees.append(len(outs))
        assert topology.degree(step) == max(out_degrees)


@pytest.mark.parametrize("name", ["ring", "torus", "exponential", "one_peer_exponential", "complete"])
def test_circulant_topologies_build_no_dense_matrix(name):
    """A built-in topology on 3,072 ranks (Megatron's 1T row) is checked and gossips
    without its 3,072 x 3,072 matrix (0.4 s each to build)."""
    topology_module._matrix.cache_clear()
    topology = build(name, 3072 if name != "one_peer_exponential" else 4096)
    for rank in range(topology.n):
        topology.in_neighbours(rank)
        topology.out_neighbours(rank)
    topology.degree(), topology.self_weight(5)
    assert topology_module._matrix.cache_info().currsize == 0


def test_exponential_and_ring_neighbours():
    expo = build("exponential", 8)
    assert expo.out_neighbours(0) == (1, 2, 4)
    assert expo.in_neighbours(0) == ((4, 0.25), (6, 0.25), (7, 0.25))
    assert build("ring", 8).in_neighbours(0) == ((1, 1 / 3), (7, 1 / 3))
    assert build("ring", 8).out_neighbours(0) == (1, 7)
    assert [build(name, 64).degree() for name in ("ring", "torus", "exponential", "complete")] == [2, 4, 6, 63]
    assert build("torus", 8).degree() == 3  # 2 x 4: the two vertical neighbours coincide


# --- custom ---------------------------------------------------------------------------

def test_custom_metropolis_hastings():
    star = build("custom", 4, edges=[(0, 1), (2, 0), (0, 3)])
    expected = np.array([[1 / 4, 1 / 4, 1 / 4, 1 / 4],
                         [1 / 4, 3 / 4, 0, 0],
                         [1 / 4, 0, 3 / 4, 0],
                         [1 / 4, 0, 0, 3 / 4]])
    np.testing.assert_allclose(star.matrix(), expected)
    assert star.edges == ((0, 1), (0, 2), (0, 3)) and not star.directed and star.period == 1
    path = build("custom", 3, edges=[(1, 0), (1, 2), (0, 1)])  # a repeated edge counts once
    np.testing.assert_allclose(path.matrix(), [[2 / 3, 1 / 3, 0], [1 / 3, 1 / 3, 1 / 3], [0, 1 / 3, 2 / 3]])
    # MH on a regular graph (a ring) is the uniform 1/3 ring
    ring = build("custom", 16, edges=[(i, (i + 1) % 16) for i in range(16)])
    np.testing.assert_allclose(ring.matrix(), build("ring", 16).matrix(), atol=1e-15)
    assert ring.spectral_gap == pytest.approx(exact_gap("ring", 16), rel=1e-9)
    assert build("custom", 1, edges=[]).matrix().tolist() == [[1.0]]


def test_custom_user_weights():
    w = np.array([[0.5, 0.5, 0, 0], [0.5, 0.25, 0.25, 0], [0, 0.25, 0.5, 0.25], [0, 0, 0.25, 0.75]])
    given = build("custom", 4, weights=w)
    np.testing.assert_allclose(given.matrix(), w)
    assert given.edges == ((0, 1), (1, 2), (2, 3)) and given.edge_weights == (0.5, 0.25, 0.25)
    listed = build("custom", 4, edges=[(0, 1), (1, 2), (2, 3), (0, 3)], weights=w.tolist())
    np.testing.assert_allclose(listed.matrix(), w)  # a listed edge may carry weight 0
    assert listed.in_neighbours(0) == ((1, 0.5),)


# --- errors ---------------------------------------------------------------------------

_RING4 = np.full((4, 4), 0.25)
_ASYM = np.array([[0.5, 0.5, 0.0], [0.25, 0.5, 0.25], [0.25, 0.0, 0.75]])

ERRORS = [
    (lambda: build("torus", 7), "prime"),
    (lambda: build("torus", 2), "'ring'"),
    (lambda: build("one_peer_exponential", 12), "power of two"),
    (lambda: build("hypercube", 8), "unknown topology"),
    (lambda: build("ring", 0), "n >= 1"),
    (lambda: build("ring", 2.5), "n >= 1"),
    (lambda: build("ring", 8, edges=[(0, 1)]), "only apply to 'custom'"),
    (lambda: build("complete", 4, weights=_RING4), "only apply to 'custom'"),
    (lambda: build("custom", 4), "needs edges="),
    (lambda: build("custom", 4, edges=[(0, 1), (2, 3)]), "disconnected"),
    (lambda: build("custom", 4, edges=[]), "disconnected"),
    (lambda: build("custom", 4, edges=[(0, 1), (1, 1), (1, 2), (2, 3)]), "self loop"),
    (lambda: build("custom", 8, edges=[(0, 1), (1, 9)]), "rank 9"),
    (lambda: build("custom", 8, edges=[(0, -1)]), "rank -1"),
    (lambda: build("custom", 4, edges=[(0, 1, 2)]), "pair of integer ranks"),
    (lambda: build("custom", 4, edges=[(0, 1.5)]), "pair of integer ranks"),
    (lambda: build("custom", 3, weights=np.full((3, 3), 0.5)), "doubly stochastic"),
    (lambda: build("custom", 3, weights=_ASYM), "not symmetric"),
    (lambda: build("custom", 2, weights=[[1.5, -0.5], [-0.5, 1.5]]), "negative"),
    (lambda: build("custom", 4, edges=[(0, 1), (1, 2), (2, 3)], weights=_RING4), "not an edge"),
    (lambda: build("custom", 4, weights=np.eye(4)), "disconnected"),
    (lambda: build("custom", 4, weights=np.eye(3)), "must be 4 x 4"),
    (lambda: build("custom", 2, weights=[[np.nan, 1], [1, 0]]), "NaN"),
    (lambda: exact_gap("one_peer_exponential", 8), "no closed-form"),
    (lambda: exact_gap("torus", 12), "no closed-form"),
    (lambda: exact_gap("exponential", 12), "no closed-form"),
    (lambda: build("ring", 8).in_neighbours(8), "out of range"),
    (lambda: build("ring", 8).matrix(-1), "step must be >= 0"),
    (lambda: Topology("ring", 8, True, 1), "make it with build()"),
    (lambda: Topology("one_peer_exponential", 8, True, 1), "period=3"),
    (lambda: Topology("custom", 3, False, 1, ((0, 1), (1, 2)), (0.8, 0.8)), "negative self weight"),
    (lambda: Topology("custom", 3, False, 1, ((1, 0), (1, 2))), "sorted"),
]


@pytest.mark.parametrize("call, fragment", ERRORS, ids=[f for _, f in ERRORS])
def test_errors_are_one_line_topology_errors(call, fragment):
    with pytest.raises(TopologyError) as info:
        call()
    message = str(info.value)
    assert fragment in message and "\n" not in message
    assert isinstance(info.value, FlexsearchError)


# --- time to accuracy -----------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 8, 64, 1024])
def test_factor_is_one_for_complete(n):
    assert iterations_factor(build("complete", n)) == 1.0
    assert iterations_factor(build("complete", n), noise_ratio=1.0, heterogeneity_ratio=5.0) == 1.0


def test_factor_grows_as_gap_shrinks():
    for n in (16, 64, 256):
        family = [build(name, n) for name in ("complete", "exponential", "torus", "ring")]
        gaps = [t.spectral_gap for t in family]
        factors = [iterations_factor(t) for t in family]
        assert gaps == sorted(gaps, reverse=True)
        assert factors == sorted(factors) and factors[0] == 1.0 and factors[-1] > factors[1]
    grid = np.linspace(1e-4, 1.0, 200)
    for n in (4, 64):
        bounds = [iteration_bound(p, 1, n) for p in grid]
        assert all(a > b for a, b in zip(bounds, bounds[1:], strict=False))
    assert iteration_bound(0.5, 4, 8) > iteration_bound(0.5, 2, 8) > iteration_bound(0.5, 1, 8)


@pytest.mark.parametrize("name, sizes", [
    ("ring", list(range(1, 40)) + [64, 128, 1024]),
    ("exponential", [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]),
    ("one_peer_exponential", [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]),
    ("torus", [1, 4, 9, 16, 25, 36, 64, 100, 256, 1024]),
])
def test_factor_not_smaller_for_more_ranks(name, sizes):
    for kw in ({}, {"noise_ratio": 1e4}, {"heterogeneity_ratio": 10.0}):
        factors = [iterations_factor(build(name, n), **kw) for n in sizes]
        assert all(f >= 1.0 for f in factors)
        assert all(b >= a - 1e-12 for a, b in zip(factors, factors[1:], strict=False)), (name, kw, factors)


def test_factor_documented_numbers_and_knobs():
    ring = [iterations_factor(build("ring", n)) for n in (8, 64, 1024)]
    expo = [iterations_factor(build("exponential", n)) for n in (8, 64, 1024)]
    assert ring == pytest.approx([1.37, 22.5, 3770], rel=0.01)
    assert expo == pytest.approx([1.08, 1.42, 1.85], rel=0.01)
    ring64 = build("ring", 64)
    base = iterations_factor(ring64)
    assert iterations_factor(ring64, heterogeneity_ratio=10.0) > base
    assert iterations_factor(ring64, noise_ratio=1e9) == pytest.approx(1.0, rel=0.05)  # linear-speedup regime
    with pytest.raises(ValueError, match="noise_ratio"):
        iterations_factor(ring64, noise_ratio=-1.0)
