"""Gossip topologies for decentralized training (D-PSGD) and the iterations they cost.

A topology on ``n`` ranks is a mixing matrix ``W`` (``n x n``, float64, doubly stochastic:
non-negative, every row and every column sums to 1). One gossip step replaces every model
by a weighted average of models, ``x_i <- sum_j W[i, j] x_j``: rank ``i`` receives the model
of every ``j != i`` with ``W[i, j] > 0`` (its in-neighbours) and sends its own to every
``k != i`` with ``W[k, i] > 0`` (its out-neighbours). Because the columns sum to 1 the
average of the models is preserved, so the mean model follows plain SGD (REFERENCE
section 3).

**The topologies** (:data:`TOPOLOGIES`), with their weight rules:

- ``"ring"``: undirected, ``i`` mixes with ``i +- 1 (mod n)``. Uniform weights ``1/(1+d)``
  with ``d`` the number of *distinct* neighbours: ``1/3`` for ``n >= 3``; ``n = 2`` has one
  neighbour (weights ``1/2``, which is the complete graph); ``n = 1`` is ``W = [[1]]``.
- ``"torus"``: undirected 2-D torus of ``r x c`` ranks (rank ``i`` at row ``i // c``, column
  ``i % c``), mixing with its four grid neighbours, wrapping around; uniform weights
  ``1/(1+d)`` as for the ring: ``1/5`` when ``r, c >= 3``. The shape (:func:`torus_shape`) is
  ``sqrt(n) x sqrt(n)`` for a square ``n``, otherwise the most square factorisation with
  ``r, c >= 3`` where one exists (``12 -> 3 x 4``, ``32 -> 4 x 8``), else the most square
  one with ``r = 2`` (``8 -> 2 x 4``, where the two vertical neighbours coincide: ``d = 3``,
  weights ``1/4``). A prime ``n`` has no torus: use ``"ring"``.
- ``"exponential"``: the static exponential graph, **directed**: ``i`` sends to
  ``i + 2^k (mod n)`` for ``k = 0 .. ceil(log2 n) - 1``, all weights (self included)
  ``1/(1 + ceil(log2 n))``. The offsets ``2^k < n`` are distinct, so ``W`` is circulant and
  doubly stochastic for every ``n`` (checked when built), symmetric only for ``n <= 3``.
- ``"one_peer_exponential"``: time varying with period ``log2 n`` (``n`` a power of two):
  at step ``t`` rank ``i`` averages with ``i + 2^(t mod log2 n)``, weights ``1/2``
  (``x_i <- (x_i + x_{i + 2^k}) / 2``; ``i`` sends to ``i - 2^k``). Directed; the product of
  any ``log2 n`` consecutive matrices is exactly ``11^T / n``.
- ``"complete"``: ``W = 11^T / n``, one step averages exactly (what an all-reduce does).
- ``"custom"``: an undirected connected graph from an edge list (or from the support of a
  given weight matrix). Metropolis-Hastings weights by default, ``W_ij = 1/(1 + max(d_i,
  d_j))`` on an edge, ``W_ii = 1 - sum_{j != i} W_ij``; or the user's symmetric doubly
  stochastic weights, with no weight outside the edges.

Every malformed request (prime ``n`` for a torus, ``n`` not a power of two for the one-peer
graph, a disconnected graph, a self loop, a rank out of range, weights that are negative,
asymmetric, not doubly stochastic or on a non-edge) raises one
:class:`~flexsearch.errors.TopologyError` whose one-line message names the problem and a fix.

**Spectral gap.** ``1 - beta`` with ``beta = ||W - 11^T/n||_2`` (spectral norm); for a
symmetric ``W`` that is the largest ``|eigenvalue|`` other than the 1, and Lian et al.'s
``rho`` is ``beta^2``. For a time-varying topology of period ``tau`` the per-step rate
``1 - ||W_{tau-1} ... W_1 W_0 - 11^T/n||_2 ** (1/tau)``; for the one-peer graph the product
is exactly ``11^T/n``, so its per-step gap is 1 (:func:`mixing_parameters` keeps ``tau``
for the convergence model, which charges for the ``tau`` steps). The complete graph has
gap 1. :func:`exact_gap` gives REFERENCE's closed forms.

All built-in topologies are circulant over the group ``Z_n`` (``Z_r x Z_c`` for the torus):
``W[i, j] = w[j - i]`` for a generator ``w``. Their spectra are the (2-D) FFT of ``w`` (a
circulant matrix is normal, so its spectral norm is its largest ``|eigenvalue|``): gaps for
``n = 1024`` take microseconds. Custom graphs use a dense ``eigvalsh``. The built-in ones' checks,
neighbours and degrees are read off the generator too (a row or column of a circulant
matrix holds the generator's entries once), so a 3,072-rank topology never builds its
``n x n`` matrix unless :meth:`Topology.matrix` is asked for it. Matrices, generators and
gaps are cached per ``(topology, step)``; the arrays handed out are read-only.

**Time to accuracy**: :func:`iterations_factor` (see there) turns ``(p, tau)`` into how many
more iterations D-PSGD needs than centralized SGD, from Koloskova et al. 2020.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from flexsearch.errors import TopologyError

TOPOLOGIES = ("ring", "torus", "exponential", "one_peer_exponential", "complete", "custom")

_DIRECTED = {"exponential": True, "one_peer_exponential": True}
_TOL = 1e-9  # doubly stochastic / symmetric tolerance on user weights and built matrices
_EXACT_ZERO = 1e-12  # a contraction below this is an exact average (float round-off only)


def _is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def _period(name: str, n: int) -> int:
    return max(1, n.bit_length() - 1) if name == "one_peer_exponential" else 1


def torus_shape(n: int) -> tuple[int, int]:
    """The ``(r, c)`` grid, ``r <= c``, ``r * c == n``, that the ``"torus"`` topology uses.

    ``sqrt(n) x sqrt(n)`` for a square ``n``; otherwise the most square factorisation (the
    largest ``r <= sqrt(n)``) with ``r, c >= 3`` where one exists, else the most square one
    (then ``r = 2``). ``n = 1`` is ``(1, 1)``; a prime ``n`` raises :class:`TopologyError`.
    """
    n = _check_n(n)
    if n == 1:
        return (1, 1)
    divisors = [r for r in range(2, math.isqrt(n) + 1) if n % r == 0]
    if not divisors:
        raise TopologyError(f"a torus needs n = r x c with r, c >= 2, but n = {n} is prime; "
                            f"use 'ring' (or another topology) for {n} ranks")
    roomy = [r for r in divisors if r >= 3 and n // r >= 3]
    r = max(roomy) if roomy else max(divisors)
    return (r, n // r)


def _check_n(n: object) -> int:
    if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 1:
        raise TopologyError(f"a topology needs a whole number n >= 1 of ranks, got {n!r}")
    return int(n)


@dataclass(frozen=True, slots=True)
class Topology:
    """A gossip topology on ``n`` ranks; make one with :func:`build`.

    ``directed`` is true when ``W`` need not be symmetric (the exponential graphs);
    ``period`` is 1 for a static topology and ``log2 n`` for the one-peer exponential graph
    (``matrix(step)`` depends on ``step % period``). ``edges`` is the custom graph's sorted
    undirected edge list ``(i, j)``, ``i < j`` (``()`` for the other topologies), and
    ``edge_weights`` the user's weight per edge (``()``: Metropolis-Hastings weights).
    """

    name: str
    n: int
    directed: bool
    period: int
    edges: tuple[tuple[int, int], ...] = ()
    edge_weights: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.name not in TOPOLOGIES:
            raise TopologyError(f"unknown topology {self.name!r}; use one of {', '.join(TOPOLOGIES)}")
        n = _check_n(self.n)
        want = (_DIRECTED.get(self.name, False), _period(self.name, n))
        if (self.directed, self.period) != want:
            raise TopologyError(f"a {self.name} topology on {n} ranks has directed={want[0]}, "
                                f"period={want[1]}, not {self.directed}, {self.period}; make it with build()")
        if self.name == "torus":
            torus_shape(n)
        elif self.name == "one_peer_exponential" and not _is_power_of_two(n):
            lower = 1 << (n.bit_length() - 1)
            raise TopologyError(f"one_peer_exponential needs n a power of two, got n = {n}; use "
                                f"'exponential' (static) or n = {lower} or {2 * lower}")
        if self.name == "custom":
            _check_custom(n, self.edges, self.edge_weights)
        elif self.edges or self.edge_weights:
            raise TopologyError(f"edges and edge weights belong to 'custom' topologies, not {self.name!r}")

    def matrix(self, step: int = 0) -> np.ndarray:
        """The ``n x n`` mixing matrix at ``step``, ``x_i <- sum_j W[i, j] x_j`` (read-only)."""
        return _matrix(self, self._step(step))

    def in_neighbours(self, rank: int, step: int = 0) -> tuple[tuple[int, float], ...]:
        """``(j, W[rank, j])`` for every ``j != rank`` with ``W[rank, j] > 0``, ascending ``j``:
        the models ``rank`` receives at ``step``. A circulant topology's row is read off its
        generator (:func:`_support`), without the ``n x n`` matrix."""
        rank, step = self._rank(rank), self._step(step)
        w = _generator(self, step)
        if w is None:
            row = _matrix(self, step)[rank]
            return tuple((int(j), float(row[j])) for j in np.flatnonzero(row > 0) if j != rank)
        return tuple((j, x) for j, x in _support(self, step, rank, +1) if j != rank)

    def out_neighbours(self, rank: int, step: int = 0) -> tuple[int, ...]:
        """Ranks ``k != rank`` with ``W[k, rank] > 0``, ascending: where ``rank`` sends its model."""
        rank, step = self._rank(rank), self._step(step)
        w = _generator(self, step)
        if w is None:
            col = _matrix(self, step)[:, rank]
            return tuple(int(k) for k in np.flatnonzero(col > 0) if k != rank)
        return tuple(k for k, _ in _support(self, step, rank, -1) if k != rank)

    def self_weight(self, rank: int, step: int = 0) -> float:
        """``W[rank, rank]`` at ``step``."""
        rank, step = self._rank(rank), self._step(step)
        w = _generator(self, step)
        return float(_matrix(self, step)[rank, rank] if w is None else w[0, 0])

    def degree(self, step: int = 0) -> int:
        """The largest out-degree at ``step``: how many models a rank sends per iteration."""
        return _degree(self, self._step(step))

    @property
    def spectral_gap(self) -> float:
        """``1 - ||W - 11^T/n||_2``; per step, ``1 - ||prod_t W_t - 11^T/n||_2 ** (1/period)``,
        for a time-varying topology; 1.0 for the complete graph (module docstring)."""
        if self.name == "complete" or self.n == 1:
            return 1.0
        return 1.0 - _contraction(self) ** (1.0 / self.period)

    def _step(self, step: int) -> int:
        step = operator.index(step)
        if step < 0:
            raise TopologyError(f"gossip step must be >= 0, got {step}")
        return step % self.period

    def _rank(self, rank: int) -> int:
        rank = operator.index(rank)
        if not 0 <= rank < self.n:
            raise TopologyError(f"rank {rank} is out of range for a {self.name} topology on "
                                f"{self.n} ranks (0..{self.n - 1})")
        return rank


def build(name: str, n: int, *, edges: Iterable[Iterable[int]] | None = None,
          weights: object | None = None) -> Topology:
    """The ``name`` topology (:data:`TOPOLOGIES`) on ``n`` ranks.

    ``edges`` (undirected pairs of ranks) and ``weights`` (an ``n x n`` array-like, symmetric
    doubly stochastic, zero outside the edges and the diagonal) only apply to ``"custom"``,
    which needs at least one of them: edges alone get Metropolis-Hastings weights, weights
    alone take their off-diagonal support as the edge list.
    """
    if name not in TOPOLOGIES:
        raise TopologyError(f"unknown topology {name!r}; use one of {', '.join(TOPOLOGIES)}")
    n = _check_n(n)
    edge_list = None if edges is None else _normalise_edges(n, edges)
    if name != "custom":
        if edge_list or weights is not None:
            raise TopologyError(f"edges= and weights= only apply to 'custom' topologies, not {name!r}; "
                                "drop them or use build('custom', n, edges=...)")
        topology = Topology(name, n, _DIRECTED.get(name, False), _period(name, n))
    else:
        if edge_list is None and weights is None:
            raise TopologyError("a custom topology needs edges= (undirected pairs of ranks) or "
                                "weights= (an n x n symmetric doubly stochastic matrix)")
        edge_weights: tuple[float, ...] = ()
        if weights is not None:
            edge_list, edge_weights = _from_weights(n, weights, edge_list)
        topology = Topology("custom", n, False, 1, tuple(edge_list or ()), edge_weights)
    for step in range(topology.period):  # check every matrix now (a circulant one by its generator)
        w = _generator(topology, step)
        if w is None:
            topology.matrix(step)
        else:
            _check_doubly_stochastic(topology, step, w, generator=True)
    return topology


def exact_gap(name: str, n: int) -> float:
    """REFERENCE section 3's closed-form spectral gap ``1 - beta``.

    ``"ring"``: ``(2/3)(1 - cos(2 pi / n))`` (1 for ``n <= 3``); ``"torus"`` on a square
    ``n = s^2``, ``s >= 3``: ``(2/5)(1 - cos(2 pi / s))``; ``"exponential"`` for ``n`` a power of
    two: ``2 / (1 + log2 n)``; ``"complete"``: 1. Other cases have no closed form here
    (:class:`TopologyError`); use ``build(name, n).spectral_gap``.
    """
    if name not in TOPOLOGIES:
        raise TopologyError(f"unknown topology {name!r}; use one of {', '.join(TOPOLOGIES)}")
    n = _check_n(n)
    if name == "complete" or n == 1:
        return 1.0
    if name == "ring":
        return 1.0 if n <= 2 else (2.0 / 3.0) * (1.0 - math.cos(2.0 * math.pi / n))
    side = math.isqrt(n)
    if name == "torus" and side * side == n and side >= 3:
        return 0.4 * (1.0 - math.cos(2.0 * math.pi / side))
    if name == "exponential" and _is_power_of_two(n):
        return 2.0 / (1.0 + math.log2(n))
    raise TopologyError(f"no closed-form gap for {name!r} on n = {n} (closed forms: ring; torus on a "
                        f"square n >= 9; exponential on a power of two; complete); use "
                        f"build({name!r}, {n}).spectral_gap")


def mixing_parameters(topology: Topology) -> tuple[float, int]:
    """Koloskova et al.'s expected consensus rate ``(p, tau)`` (their Assumption 4).

    ``||W_{tau-1} ... W_0 X - Xbar||_F^2 <= (1 - p) ||X - Xbar||_F^2`` for every stack of models
    ``X`` (``Xbar`` its row mean), with ``tau`` the period and ``1 - p = ||prod_t W_t -
    11^T/n||_2^2``. For a static topology ``p = 1 - beta^2`` (Lian et al.'s ``1 - rho``); for
    the one-peer exponential graph ``p = 1``, ``tau = log2 n``. The bound holds for any doubly
    stochastic ``W``, symmetric or not.
    """
    if topology.name == "complete" or topology.n == 1:
        return 1.0, 1
    return 1.0 - _contraction(topology) ** 2, topology.period


def iteration_bound(p: float, tau: int, n: int, *, noise_ratio: float = 100.0,
                    heterogeneity_ratio: float = 0.0) -> float:
    """Koloskova et al.'s non-convex iteration bound, in units of ``L F_0 / eps``:

    ``noise_ratio / n + (sqrt(heterogeneity_ratio) tau + sqrt(noise_ratio p tau)) / p + tau / p``

    (:func:`iterations_factor` gives the source and the assumptions). Decreasing in ``p``,
    increasing in ``tau``; ``p`` in ``(0, 1]``, ``tau >= 1``, ``n >= 1``.
    """
    if not 0.0 < p <= 1.0 or tau < 1 or n < 1:
        raise ValueError(f"need 0 < p <= 1, tau >= 1, n >= 1; got p={p}, tau={tau}, n={n}")
    if not (noise_ratio >= 0.0 and heterogeneity_ratio >= 0.0
            and math.isfinite(noise_ratio) and math.isfinite(heterogeneity_ratio)):
        raise ValueError(f"noise_ratio and heterogeneity_ratio must be finite and >= 0, got "
                         f"{noise_ratio}, {heterogeneity_ratio}")
    return (noise_ratio / n + math.sqrt(heterogeneity_ratio) * tau / p
            + math.sqrt(noise_ratio * tau / p) + tau / p)


def iterations_factor(topology: Topology, *, noise_ratio: float = 100.0,
                      heterogeneity_ratio: float = 0.0) -> float:
    """How many times more iterations D-PSGD on ``topology`` needs than centralized SGD
    (all-reduce or a parameter server, same global batch) to reach the same accuracy.

    **Source.** Koloskova, Loizou, Boreiri, Jaggi, Stich, "A Unified Theory of Decentralized
    SGD with Changing Topology and Local Updates", ICML 2020 (arXiv:2003.10422), Theorem 2,
    non-convex case: D-SGD with mixing matrices that satisfy the expected consensus rate
    ``(p, tau)`` (:func:`mixing_parameters`) reaches ``(1/T) sum_t E||grad f(xbar_t)||^2 <=
    eps`` after

        ``T = O( sigma^2/(n eps^2) + (zeta tau + sigma sqrt(p tau)) / (p eps^{3/2}) + tau/(p eps) ) * L F_0``

    iterations (``sigma^2``: variance of one worker's stochastic gradient; ``zeta^2``: spread of
    the workers' local gradients, 0 for i.i.d. data; ``L``: smoothness; ``F_0 = f(x_0) - f*``).
    Divided by ``L F_0 / eps`` this is :func:`iteration_bound` of ``s = sigma^2/eps``
    (``noise_ratio``) and ``z = zeta^2/eps`` (``heterogeneity_ratio``):

        ``B(p, tau, n) = s/n + (sqrt(z) tau + sqrt(s p tau)) / p + tau/p``

    and the factor is ``B(p, tau, n) / B(1, 1, n)``: the complete graph (``W = 11^T/n``, the
    exact average an all-reduce computes, so D-SGD on it *is* centralized SGD) is the
    baseline. Comparing the bound with itself makes ``L F_0`` cancel and leaves only the
    topology's effect.

    **Assumptions.** (1) The constants hidden in the ``O`` are all 1, and the paper's
    gradient-growth constants ``M`` and ``P`` are 0. (2) ``noise_ratio`` (default 100: the
    target squared gradient norm is 1% of one worker's gradient-noise variance) and
    ``heterogeneity_ratio`` (default 0: i.i.d. shuffled data, as in Lian et al. 2017's
    experiments) describe the training run; both are guesses to override per workload.
    (3) The bound applies to any doubly stochastic ``W`` through ``p`` (the paper states it
    for symmetric ``W``; directed doubly stochastic ``W`` contract the same way). (4) It is a
    worst-case upper bound: real runs often do better (Lian et al. train ResNet-20 on a
    112-GPU ring with little loss per epoch), so treat the factor as a pessimistic estimate.

    **Properties.** ``>= 1``; exactly 1 for ``p = 1, tau = 1`` (complete graph, ``n <= 2``
    rings); larger for a smaller gap (``p = 1 - (1 - gap)^2``) or a longer period; for fixed
    ``(p, tau)`` not smaller for more ranks (the shared ``s/n`` term shrinks), and the
    families' gaps shrink with ``n``. Pure: a function of the topology and the keywords.

    **Numbers** (defaults), at n = 8 / 64 / 1024:

    - ring: 1.37 / 22.5 / 3770 (gap 0.195 / 3.2e-3 / 1.25e-5);
    - exponential: 1.08 / 1.42 / 1.85 (gap 1/2, 2/7, 2/11);
    - one-peer exponential: 1.40 / 2.55 / 3.76 (``p = 1``, ``tau = 3 / 6 / 10``: the bound
      charges the ``tau`` steps an exact average takes, so it ranks the one-peer graph
      behind the static one, which Ying et al., NeurIPS 2021, find too pessimistic);
    - torus (2 x 4, 8 x 8, 32 x 32): 1.08 / 2.18 / 13.2.
    """
    p, tau = mixing_parameters(topology)
    return bound_factor(p, tau, topology.n, noise_ratio, heterogeneity_ratio)


def bound_factor(p: float, tau: int, n: int, noise_ratio: float = 100.0, heterogeneity_ratio: float = 0.0) -> float:
    """:func:`iterations_factor` from a topology's ``(p, tau)`` and rank count:
    ``B(p, tau, n) / B(1, 1, n)``, at least 1, exactly 1 for ``p = 1, tau = 1``."""
    if p >= 1.0 and tau == 1:
        return 1.0
    kw = {"noise_ratio": noise_ratio, "heterogeneity_ratio": heterogeneity_ratio}
    return max(1.0, iteration_bound(p, tau, n, **kw) / iteration_bound(1.0, 1, n, **kw))


# --- building ---------------------------------------------------------------------------

def _normalise_edges(n: int, edges: Iterable[Iterable[int]]) -> list[tuple[int, int]]:
    out: set[tuple[int, int]] = set()
    for edge in edges:
        try:
            i, j = (operator.index(v) for v in edge)
        except (TypeError, ValueError):
            raise TopologyError(f"edge {edge!r} is not a pair of integer ranks; "
                                "give edges as [(i, j), ...]") from None
        if i == j:
            raise TopologyError(f"edge ({i}, {j}) is a self loop; drop it (the self weight "
                                "W_ii = 1 - sum of the row is implied)")
        for r in (i, j):
            if not 0 <= r < n:
                raise TopologyError(f"edge ({i}, {j}) names rank {r}, but the ranks are 0..{n - 1} "
                                    f"(n = {n})")
        out.add((min(i, j), max(i, j)))
    return sorted(out)


def _from_weights(n: int, weights: object, edge_list: list[tuple[int, int]] | None
                  ) -> tuple[list[tuple[int, int]], tuple[float, ...]]:
    """Check a user weight matrix; return the edge list and the weight of each edge."""
    try:
        w = np.array(weights, dtype=np.float64)
    except (TypeError, ValueError):
        raise TopologyError("weights= must be an n x n array of numbers") from None
    if w.shape != (n, n):
        raise TopologyError(f"weights= must be {n} x {n} for n = {n}, got shape {w.shape}")
    if not np.isfinite(w).all():
        raise TopologyError("weights= holds NaN or infinite entries; give finite weights")
    i, j = np.unravel_index(np.argmin(w), w.shape)
    if w[i, j] < -_TOL:
        raise TopologyError(f"weights[{i}, {j}] = {w[i, j]:.6g} is negative; mixing weights must be >= 0")
    i, j = np.unravel_index(np.argmax(np.abs(w - w.T)), w.shape)
    if abs(w[i, j] - w[j, i]) > _TOL:
        raise TopologyError(f"weights are not symmetric: weights[{i}, {j}] = {w[i, j]:.6g} but "
                            f"weights[{j}, {i}] = {w[j, i]:.6g}; an undirected graph needs W = W^T")
    sums = w.sum(axis=1)
    i = int(np.argmax(np.abs(sums - 1.0)))
    if abs(sums[i] - 1.0) > _TOL:
        raise TopologyError(f"weights are not doubly stochastic: row {i} sums to {sums[i]:.9g}, not 1; "
                            "rescale it (or use the default Metropolis-Hastings weights)")
    support = [(int(a), int(b)) for a, b in zip(*np.nonzero(np.triu(w, 1) > 0), strict=True)]
    if edge_list is None:
        edge_list = support
    else:
        listed = set(edge_list)
        extra = [e for e in support if e not in listed]
        if extra:
            a, b = extra[0]
            raise TopologyError(f"weights[{a}, {b}] = {w[a, b]:.6g} but ({a}, {b}) is not an edge; "
                                "add the edge or set its weight to 0")
    return edge_list, tuple(float(w[a, b]) for a, b in edge_list)


def _check_custom(n: int, edges: tuple[tuple[int, int], ...], weights: tuple[float, ...]) -> None:
    if list(edges) != _normalise_edges(n, edges):
        raise TopologyError("a custom topology's edges must be sorted (i, j) pairs with i < j and "
                            "no repeats; make it with build('custom', n, edges=...)")
    if weights:
        if len(weights) != len(edges):
            raise TopologyError(f"{len(weights)} edge weights for {len(edges)} edges; give one per edge")
        if not all(math.isfinite(x) and x >= 0.0 for x in weights):
            raise TopologyError("edge weights must be finite and >= 0")
        sums = np.zeros(n)
        for (i, j), x in zip(edges, weights, strict=True):
            sums[i] += x
            sums[j] += x
        if sums.max() > 1.0 + _TOL:
            r = int(np.argmax(sums))
            raise TopologyError(f"rank {r}'s edge weights sum to {sums[r]:.9g} > 1, leaving a negative "
                                "self weight; lower them")
    live = [e for e, x in zip(edges, weights or [1.0] * len(edges), strict=True) if x > 0]
    parent = list(range(n))

    def root(a: int) -> int:
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    for i, j in live:
        parent[root(i)] = root(j)
    roots = {root(a) for a in range(n)}
    if len(roots) > 1:
        cut = next(a for a in range(n) if root(a) != root(0))
        raise TopologyError(f"the custom graph on {n} ranks is disconnected ({len(roots)} components; "
                            f"rank {cut} cannot reach rank 0); add edges joining the components")


@functools.lru_cache(maxsize=256)
def _generator(topology: Topology, step: int) -> np.ndarray | None:
    """``w`` with ``W[i, j] = w[j - i]`` over ``Z_r x Z_c`` (shape ``(r, c)``); None for custom."""
    name, n = topology.name, topology.n
    if name == "custom":
        return None
    if name == "complete":
        w = np.full((1, n), 1.0 / n)
    elif name == "one_peer_exponential":
        w = np.zeros((1, n))
        w[0, 0] = 0.5
        w[0, (1 << step) % n] += 0.5  # n = 1: the single rank keeps its model
    else:
        r, c = torus_shape(n) if name == "torus" else (1, n)
        if name == "exponential":
            offsets = {(0, -(1 << k) % n) for k in range((n - 1).bit_length())}  # ceil(log2 n) of them
        else:
            offsets = {(0, 1 % c), (0, -1 % c), (1 % r, 0), (-1 % r, 0)}
        offsets.discard((0, 0))
        w = np.zeros((r, c))
        w[0, 0] = 1.0 / (1 + len(offsets))
        for a, b in offsets:
            w[a, b] = 1.0 / (1 + len(offsets))
    w.flags.writeable = False
    return w


@functools.lru_cache(maxsize=16)
def _matrix(topology: Topology, step: int) -> np.ndarray:
    n = topology.n
    w = _generator(topology, step)
    if w is None:
        m = np.zeros((n, n))
        degree = np.zeros(n, dtype=np.int64)
        for i, j in topology.edges:
            degree[i] += 1
            degree[j] += 1
        weights = topology.edge_weights or [1.0 / (1 + max(degree[i], degree[j])) for i, j in topology.edges]
        for (i, j), x in zip(topology.edges, weights, strict=True):
            m[i, j] = m[j, i] = x
        np.fill_diagonal(m, 0.0)
        np.fill_diagonal(m, np.maximum(0.0, 1.0 - m.sum(axis=1)))
    else:
        r, c = w.shape
        idx = np.arange(n)
        rows, cols = idx // c, idx % c
        m = w[(rows[None, :] - rows[:, None]) % r, (cols[None, :] - cols[:, None]) % c]
    _check_doubly_stochastic(topology, step, m)
    m.flags.writeable = False
    return m


def _support(topology: Topology, step: int, rank: int, sign: int) -> list[tuple[int, float]]:
    """The nonzero entries of row ``rank`` (``sign`` +1) or column ``rank`` (-1) of a
    circulant topology's matrix at ``step``, ascending, from its generator ``w`` (``r x
    c``): ``W[i, j] = w[(r_j - r_i) mod r, (c_j - c_i) mod c]`` with ``i = r_i c + c_i``, so
    row ``i`` holds ``w[a, b]`` at ``j = ((r_i + a) mod r) c + (c_i + b) mod c``, and column
    ``j`` holds it at row ``((r_j - a) mod r) c + (c_j - b) mod c``."""
    r, c, a, b, x = _generator_entries(topology, step)
    ri, ci = divmod(rank, c)
    at = ((ri + sign * a) % r) * c + (ci + sign * b) % c
    return sorted(zip(at.tolist(), x, strict=True))


@functools.lru_cache(maxsize=256)
def _generator_entries(topology: Topology, step: int) -> tuple[int, int, np.ndarray, np.ndarray, list[float]]:
    """A circulant topology's generator's shape ``(r, c)`` and nonzero entries ``w[a, b]``:
    ``(r, c, a, b, [w[a, b], ...])``."""
    w = _generator(topology, step)
    a, b = np.nonzero(w > 0)
    return *w.shape, a, b, w[a, b].tolist()


def _check_doubly_stochastic(topology: Topology, step: int, m: np.ndarray, generator: bool = False) -> None:
    """``m`` is non-negative and its rows and columns sum to 1; with ``generator``, ``m``
    is a circulant matrix's generator, each of whose rows and columns holds the
    generator's entries once (so sums to the generator's sum)."""
    what = f"the {topology.name} mixing matrix on {topology.n} ranks (step {step})"
    if m.min() < 0.0:
        raise TopologyError(f"{what} has a negative entry; this topology cannot be built")
    if generator:
        m = np.array([[m.sum()]])
    for axis, kind in ((1, "row"), (0, "column")):
        sums = m.sum(axis=axis)
        k = int(np.argmax(np.abs(sums - 1.0)))
        if abs(sums[k] - 1.0) > _TOL:
            raise TopologyError(f"{what} is not doubly stochastic ({kind} {k} sums to {sums[k]:.9g}); "
                                "this topology cannot be used for D-PSGD on this n")


@functools.lru_cache(maxsize=256)
def _contraction(topology: Topology) -> float:
    """``||W_{period-1} ... W_0 - 11^T/n||_2``; an exact average (below round-off) is 0."""
    if _generator(topology, 0) is not None:
        # Circulant over a group: eigenvalues are the FFT of w, products multiply per frequency.
        spectrum = np.ones(_generator(topology, 0).shape, dtype=np.complex128)
        for step in range(topology.period):
            spectrum = spectrum * np.fft.fft2(_generator(topology, step))
        spectrum[0, 0] = 0.0  # the eigenvalue 1 of the consensus direction, removed by -11^T/n
        beta = float(np.abs(spectrum).max())
    else:
        m = topology.matrix(0) - 1.0 / topology.n
        beta = float(np.abs(np.linalg.eigvalsh(m)).max())  # custom W is symmetric
    return 0.0 if beta < _EXACT_ZERO else min(beta, 1.0)


@functools.lru_cache(maxsize=256)
def _degree(topology: Topology, step: int) -> int:
    w = _generator(topology, step)
    if w is not None:  # every column holds the generator's entries: the same out-degree for all
        return int((w > 0).sum()) - int(w[0, 0] > 0)
    support = _matrix(topology, step) > 0
    np.fill_diagonal(support, False)
    return int(support.sum(axis=0).max())  # column k: the ranks that receive k's model
