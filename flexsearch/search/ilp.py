"""Exact solver for the Alpa-style "one configuration per operator" assignment problem.

A pure function over numbers: ``n`` units (operators, or groups of them), unit ``u`` has
candidates ``a = 0 .. A_u - 1`` (its parallel configurations). Choosing ``a`` for ``u``
costs ``node_costs[u][a]``; an edge ``(u, v, C)`` costs ``C[a][b]`` when ``u`` takes
``a`` and ``v`` takes ``b`` (resharding). Optionally unit ``u`` with candidate ``a`` puts
``memory[u][a][d]`` bytes on device ``d``, which holds ``capacity[d]``. Find the choice of
minimum total cost whose memory fits every device.

Formulation (CP-SAT, all variables boolean)::

    x[u,a]                          1 iff unit u takes candidate a
    sum_a x[u,a] = 1                                       for every u
    y[e,a,b]                        1 iff u takes a and v takes b, for edge e = (u, v)
    sum_b y[e,a,b] = x[u,a],  sum_a y[e,a,b] = x[v,b]      for every a, b
    sum_{u,a} memory[u][a][d] * x[u,a] <= capacity[d]       for every device d
    minimise  sum_{u,a} node[u][a] * x[u,a] + sum_{e,a,b} C_e[a][b] * y[e,a,b]

Because ``x[u,.]`` and ``x[v,.]`` are one-hot, the two marginal constraints force
``y[e,.,.]`` to be their outer product: the linearisation is exact, not a relaxation.

Before the model is built the edges are normalised, which never changes any plan's cost:

* a self edge ``(u, u, C)`` adds its diagonal ``C[a][a]`` to ``node[u][a]``;
* edges between the same pair add, ``(v, u, C)`` being merged into ``(u, v)`` as ``C^T``;
* each merged matrix is reduced: its row minima ``r[a]`` move to ``node[u][a]``, then the
  column minima ``c[b]`` of ``C - r`` move to ``node[v][b]``. The rest ``C'`` is >= 0 and
  ``C[a][b] = r[a] + c[b] + C'[a][b]``. Only edges with ``C' != 0`` get ``y`` variables, so
  an edge whose cost depends on one side only (or whose end has one candidate) is free.

Integer scaling. CP-SAT wants integer coefficients. Costs are divided by a power of two
``unit = 2**k``, the smallest with ``M / unit < 2**40`` where ``M = sum_u max_a node[u][a]
+ sum_e max C'_e`` bounds every plan's cost, and rounded to the nearest integer; so the
objective of any plan stays below ``2**40 + #terms`` (far inside int64) and each of the
``T = n + #y-edges`` terms of a plan is off by at most ``unit / 2 < M * 2**-40``. A plan
proved "optimal" is therefore within ``T * unit`` (about ``T * 1e-12 * M``) of the true
optimum. Memory is scaled per device by its own power of two (``max(capacity, largest
possible load) / unit < 2**40``), each term rounded UP and the capacity rounded DOWN: a
returned plan always satisfies the float constraint (:func:`fits`), while a plan within
``n * unit`` bytes of a capacity may be rejected. On a device whose capacity and largest
possible load are below ``2**40`` bytes, ``unit <= 1`` and integer byte counts are scaled
exactly (division by a power of two is exact). A device that every plan fits (the sum of
per-unit peak loads is within capacity) gets no constraint at all.

The reported ``objective`` is always recomputed in float from the problem
(:func:`evaluate`), never taken from the scaled model.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass

from ortools.sat.python import cp_model

__all__ = [
    "AssignmentProblem",
    "AssignmentResult",
    "brute_force",
    "evaluate",
    "fits",
    "solve_assignment",
]

_SCALE_BITS = 40  # scaled costs and loads stay below 2**40 (+ rounding)

Matrix = tuple[tuple[float, ...], ...]


def _number(value, what: str) -> float:
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a number, got {value!r}") from None
    if not math.isfinite(x) or x < 0:
        raise ValueError(f"{what} must be finite and >= 0, got {value!r}")
    return x


def _index(value, what: str) -> int:
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{what} must be an integer, got {value!r}") from None


def _vector(values, length: int | None, what: str) -> tuple[float, ...]:
    out = tuple(_number(x, f"{what}[{i}]") for i, x in enumerate(values))
    if length is not None and len(out) != length:
        raise ValueError(f"{what} has {len(out)} entries, expected {length}")
    return out


@dataclass(frozen=True)
class AssignmentProblem:
    """Costs and memory of a one-candidate-per-unit assignment (see the module docstring).

    ``node_costs[u][a]``: cost of unit ``u`` taking candidate ``a`` (>= 1 candidate each).
    ``edges``: ``(u, v, cost)`` with ``cost[a][b]`` the cost when ``u`` takes ``a`` and
    ``v`` takes ``b``; self edges count their diagonal only, parallel edges add.
    ``memory[u][a][d]``: bytes unit ``u`` puts on device ``d`` with candidate ``a``;
    ``capacity[d]``: bytes of device ``d``. Both empty: no memory constraint.

    Nested sequences (lists, numpy arrays) are accepted and stored as tuples of floats.
    Every number must be finite and >= 0; a malformed problem raises ``ValueError``.
    """

    node_costs: tuple[tuple[float, ...], ...]
    edges: tuple[tuple[int, int, Matrix], ...] = ()
    memory: tuple[Matrix, ...] = ()
    capacity: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        nodes = tuple(
            _vector(row, None, f"node_costs[{u}]") for u, row in enumerate(self.node_costs)
        )
        sizes = [len(row) for row in nodes]
        for u, size in enumerate(sizes):
            if size == 0:
                raise ValueError(f"node_costs[{u}] is empty: every unit needs a candidate")
        n = len(nodes)

        edges = []
        for i, edge in enumerate(self.edges):
            if len(edge) != 3:
                raise ValueError(f"edges[{i}] must be (u, v, cost), got {len(edge)} items")
            u, v = (_index(w, f"edges[{i}] endpoint") for w in edge[:2])
            for w in (u, v):
                if not 0 <= w < n:
                    raise ValueError(f"edges[{i}] names unit {w}, but there are {n} units")
            rows = tuple(edge[2])
            if len(rows) != sizes[u]:
                raise ValueError(
                    f"edges[{i}] cost has {len(rows)} rows, unit {u} has {sizes[u]} candidates"
                )
            matrix = tuple(
                _vector(row, sizes[v], f"edges[{i}] cost[{a}]") for a, row in enumerate(rows)
            )
            edges.append((u, v, matrix))

        capacity = _vector(self.capacity, None, "capacity")
        memory: tuple[Matrix, ...] = ()
        if len(self.memory) and not capacity:
            raise ValueError("memory is given without capacity: give both or neither")
        if capacity:
            if len(self.memory) != n:
                raise ValueError(f"memory has {len(self.memory)} units, expected {n}")
            memory = []
            for u, per_unit in enumerate(self.memory):
                per_unit = tuple(per_unit)
                if len(per_unit) != sizes[u]:
                    raise ValueError(
                        f"memory[{u}] has {len(per_unit)} candidates, expected {sizes[u]}"
                    )
                memory.append(
                    tuple(
                        _vector(row, len(capacity), f"memory[{u}][{a}]")
                        for a, row in enumerate(per_unit)
                    )
                )
            memory = tuple(memory)

        object.__setattr__(self, "node_costs", nodes)
        object.__setattr__(self, "edges", tuple(edges))
        object.__setattr__(self, "memory", memory)
        object.__setattr__(self, "capacity", capacity)

    @property
    def num_units(self) -> int:
        return len(self.node_costs)


@dataclass(frozen=True)
class AssignmentResult:
    """A solver's answer.

    ``choice``: candidate per unit (``()`` when none was found). ``objective``: its float
    cost from :func:`evaluate` (``inf`` when none). ``optimal``: optimality was proved (up
    to the integer scaling). ``status``: ``"optimal"``, ``"feasible"`` (time limit hit with
    a plan), ``"infeasible"`` (proved: no plan fits memory) or ``"unknown"`` (time limit
    hit before any plan was found).
    """

    choice: tuple[int, ...]
    objective: float
    optimal: bool
    status: str


def _check_choice(problem: AssignmentProblem, choice: Sequence[int], what: str) -> tuple:
    choice = tuple(_index(a, what) for a in choice)
    if len(choice) != problem.num_units:
        raise ValueError(f"{what} has {len(choice)} entries, expected {problem.num_units}")
    for u, a in enumerate(choice):
        if not 0 <= a < len(problem.node_costs[u]):
            raise ValueError(
                f"{what}[{u}] = {a}, but unit {u} has {len(problem.node_costs[u])} candidates"
            )
    return choice


def evaluate(problem: AssignmentProblem, choice: Sequence[int]) -> float:
    """Total float cost of ``choice``: chosen node costs plus every edge's chosen entry."""
    choice = _check_choice(problem, choice, "choice")
    terms = [problem.node_costs[u][a] for u, a in enumerate(choice)]
    terms += [cost[choice[u]][choice[v]] for u, v, cost in problem.edges]
    return math.fsum(terms)


def fits(problem: AssignmentProblem, choice: Sequence[int]) -> bool:
    """Whether every device's load under ``choice`` (an exactly rounded sum) <= capacity."""
    choice = _check_choice(problem, choice, "choice")
    return all(
        math.fsum(problem.memory[u][a][d] for u, a in enumerate(choice)) <= cap
        for d, cap in enumerate(problem.capacity)
    )


def _infeasible() -> AssignmentResult:
    return AssignmentResult((), math.inf, False, "infeasible")


def brute_force(problem: AssignmentProblem) -> AssignmentResult:
    """Enumerate every choice (``itertools.product`` order); exponential, for tiny problems.

    Ties: the first choice found with the smallest :func:`evaluate` among those that
    :func:`fits`, i.e. the lexicographically smallest optimal choice.
    """
    best, best_cost = None, math.inf
    for choice in itertools.product(*(range(len(row)) for row in problem.node_costs)):
        if problem.capacity and not fits(problem, choice):
            continue
        cost = evaluate(problem, choice)
        if best is None or cost < best_cost:
            best, best_cost = choice, cost
    if best is None:
        return _infeasible()
    return AssignmentResult(tuple(best), best_cost, True, "optimal")


def _normalise(problem: AssignmentProblem) -> tuple[list[list[float]], dict]:
    """Node costs with self edges and edge row/column minima folded in, and the reduced
    remainders ``C'`` (keyed ``(u, v)``, ``u < v``) that are not all zero."""
    node = [list(row) for row in problem.node_costs]
    merged: dict[tuple[int, int], list[list[float]]] = {}
    for u, v, cost in problem.edges:
        if u == v:
            for a in range(len(node[u])):
                node[u][a] += cost[a][a]
            continue
        if u > v:
            u, v, cost = v, u, tuple(zip(*cost, strict=True))
        acc = merged.setdefault((u, v), [[0.0] * len(node[v]) for _ in node[u]])
        for a, row in enumerate(cost):
            for b, c in enumerate(row):
                acc[a][b] += c
    reduced = {}
    for (u, v), m in merged.items():
        for a, row in enumerate(m):
            r = min(row)
            node[u][a] += r
            m[a] = [c - r for c in row]
        for b in range(len(node[v])):
            c = min(row[b] for row in m)
            node[v][b] += c
            for row in m:
                row[b] -= c
        if any(c > 0 for row in m for c in row):
            reduced[(u, v)] = m
    return node, reduced


def _unit(bound: float) -> float:
    """Smallest power of two with ``bound / unit < 2**_SCALE_BITS`` (1.0 for 0)."""
    if bound <= 0:
        return 1.0
    return math.ldexp(1.0, max(math.frexp(bound)[1] - _SCALE_BITS, -1074))


def solve_assignment(
    problem: AssignmentProblem,
    *,
    time_limit_s: float = 10.0,
    seed: int = 0,
    workers: int = 1,
    hint: Sequence[int] | None = None,
    deterministic: bool = False,
) -> AssignmentResult:
    """Minimise the total cost subject to memory with CP-SAT (formulation: module docstring).

    Deterministic for fixed inputs, ``seed`` and ``workers`` unless the time limit cuts the
    search; with ``deterministic=True`` the limit is CP-SAT's deterministic time
    (``max_deterministic_time``, about seconds of work, independent of machine load), so
    even a cut search returns the same result on every run. ``hint`` (one candidate per unit; it need not fit memory) is passed to CP-SAT
    as a solution hint; a malformed hint raises ``ValueError``. Never raises for an
    infeasible problem: returns status ``"infeasible"``, ``choice=()``, ``objective=inf``.
    Ties between optimal choices are broken arbitrarily (but deterministically). If the
    time limit passes before any plan is found, a hint that fits is returned as
    ``"feasible"``, else status ``"unknown"``. Hundreds of units with several candidates
    may need ``workers=8`` (CP-SAT's parallel portfolio) or a good hint to solve in time.
    """
    if time_limit_s <= 0:
        raise ValueError(f"time_limit_s must be > 0, got {time_limit_s}")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if hint is not None:
        hint = _check_choice(problem, hint, "hint")
    n = problem.num_units
    if n == 0:  # the empty choice: cost 0, no load (capacities are >= 0)
        return AssignmentResult((), 0.0, True, "optimal")

    node, reduced = _normalise(problem)
    model = cp_model.CpModel()
    x = [[model.new_bool_var(f"x{u}_{a}") for a in range(len(row))] for u, row in enumerate(node)]
    for xs in x:
        model.add_exactly_one(xs)

    bound = math.fsum(max(row) for row in node)
    bound += math.fsum(max(map(max, m)) for m in reduced.values())
    unit = _unit(bound)
    obj_vars, obj_coeffs = [], []

    def add_terms(variables, costs) -> None:
        for var, c in zip(variables, costs, strict=True):
            k = round(c / unit)
            if k:
                obj_vars.append(var)
                obj_coeffs.append(k)

    for xs, row in zip(x, node, strict=True):
        add_terms(xs, row)
    for (u, v), m in reduced.items():
        y = [[model.new_bool_var(f"y{u}_{v}_{a}_{b}") for b in m[0]] for a in range(len(m))]
        for a, ys in enumerate(y):
            model.add(cp_model.LinearExpr.sum(ys) == x[u][a])
        for b in range(len(m[0])):
            model.add(cp_model.LinearExpr.sum([ys[b] for ys in y]) == x[v][b])
        for a, ys in enumerate(y):
            add_terms(ys, m[a])
            if hint is not None:
                for b, var in enumerate(ys):
                    model.add_hint(var, a == hint[u] and b == hint[v])

    for d, cap in enumerate(problem.capacity):
        peaks = [max(row[d] for row in per_unit) for per_unit in problem.memory]
        if math.fsum(peaks) <= cap:
            continue  # no plan can exceed this device
        mem_unit = _unit(max(cap, math.fsum(peaks)))
        mem_vars, mem_coeffs = [], []
        for xs, per_unit in zip(x, problem.memory, strict=True):
            for var, row in zip(xs, per_unit, strict=True):
                k = math.ceil(row[d] / mem_unit)
                if k:
                    mem_vars.append(var)
                    mem_coeffs.append(k)
        model.add(
            cp_model.LinearExpr.weighted_sum(mem_vars, mem_coeffs) <= math.floor(cap / mem_unit)
        )

    model.minimize(cp_model.LinearExpr.weighted_sum(obj_vars, obj_coeffs))
    if hint is not None:
        for u, xs in enumerate(x):
            for a, var in enumerate(xs):
                model.add_hint(var, a == hint[u])

    solver = cp_model.CpSolver()
    if deterministic:
        solver.parameters.max_deterministic_time = float(time_limit_s)
    else:
        solver.parameters.max_time_in_seconds = float(time_limit_s)
    solver.parameters.random_seed = int(seed)
    solver.parameters.num_workers = int(workers)
    if workers == 1:
        # The marginal constraints make the LP relaxation the (strong) local polytope; level
        # 2 puts them all in CP-SAT's LP, which finds and proves optima far sooner here. (A
        # parallel portfolio already runs such a worker among others.)
        solver.parameters.linearization_level = 2
    status = solver.solve(model)

    if status == cp_model.INFEASIBLE:
        return _infeasible()
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        if status == cp_model.UNKNOWN:  # no plan in time: fall back on a hint that fits
            if hint is not None and fits(problem, hint):
                return AssignmentResult(hint, evaluate(problem, hint), False, "feasible")
            return AssignmentResult((), math.inf, False, "unknown")
        raise RuntimeError(f"CP-SAT failed: {solver.status_name(status)}")
    choice = tuple(next(a for a, var in enumerate(xs) if solver.boolean_value(var)) for xs in x)
    optimal = status == cp_model.OPTIMAL
    return AssignmentResult(
        choice, evaluate(problem, choice), optimal, "optimal" if optimal else "feasible"
    )
