"""The CP-SAT assignment solver against exhaustive enumeration, plus its edge cases."""

from __future__ import annotations

import math
import random

import pytest

from flexsearch.search.ilp import (
    AssignmentProblem,
    AssignmentResult,
    brute_force,
    evaluate,
    fits,
    solve_assignment,
)


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


def random_problem(rng: random.Random) -> AssignmentProblem:
    """2..6 units, 1..5 candidates; self, parallel and reversed edges; optional memory."""
    n = rng.randint(2, 6)
    sizes = [rng.randint(1, 5) for _ in range(n)]
    integral = rng.random() < 0.3  # small integers: many ties

    def cost() -> float:
        if rng.random() < 0.2:
            return 0.0
        return float(rng.randint(0, 4)) if integral else rng.uniform(0, 10)

    nodes = [[cost() for _ in range(k)] for k in sizes]
    edges = []
    for _ in range(rng.randint(0, 9)):
        u, v = rng.randrange(n), rng.randrange(n)
        if rng.random() < 0.15:
            v = u
        scale = 0.0 if rng.random() < 0.1 else 1.0
        edges.append((u, v, [[scale * cost() for _ in range(sizes[v])] for _ in range(sizes[u])]))
        if rng.random() < 0.2:  # a parallel edge, maybe reversed
            edges.append((v, u, [[cost() for _ in range(sizes[u])] for _ in range(sizes[v])]))
    if rng.random() < 0.35:
        return AssignmentProblem(nodes, edges)
    devices = rng.randint(1, 3)
    memory = [
        [[float(rng.randint(0, 100)) for _ in range(devices)] for _ in range(k)] for k in sizes
    ]
    capacity = []
    for d in range(devices):
        low = sum(min(row[d] for row in per) for per in memory)
        high = sum(max(row[d] for row in per) for per in memory)
        capacity.append(max(0.0, rng.uniform(low - 0.15 * (high - low) - 5, high)))
    return AssignmentProblem(nodes, edges, memory, capacity)


@pytest.mark.parametrize("seed", range(60))
def test_matches_brute_force(seed):
    problem = random_problem(random.Random(seed))
    exact = brute_force(problem)
    got = solve_assignment(problem)
    assert (got.status == "infeasible") == (exact.status == "infeasible")
    if exact.status == "infeasible":
        assert got == AssignmentResult((), math.inf, False, "infeasible")
        return
    assert got.status == "optimal" and got.optimal
    assert fits(problem, got.choice)
    assert got.objective == evaluate(problem, got.choice)
    assert close(got.objective, exact.objective)


def test_infeasible_cases_occur_in_the_suite():
    statuses = {brute_force(random_problem(random.Random(s))).status for s in range(60)}
    assert statuses == {"optimal", "infeasible"}


def chain(capacity: float | None) -> AssignmentProblem:
    """Three units: candidate 0 is fast but needs 60 bytes, candidate 1 slow and needs 10."""
    nodes = [(1.0, 3.0)] * 3
    edges = [(0, 1, ((0.0, 0.5), (0.5, 0.0))), (1, 2, ((0.0, 0.5), (0.5, 0.0)))]
    if capacity is None:
        return AssignmentProblem(nodes, edges)
    return AssignmentProblem(nodes, edges, [((60.0,), (10.0,))] * 3, (capacity,))


def test_memory_forces_costlier_choice():
    assert solve_assignment(chain(None)).choice == (0, 0, 0)
    assert solve_assignment(chain(180.0)).choice == (0, 0, 0)  # exactly at capacity
    tight = solve_assignment(chain(130.0))  # two fast units fit; a slow end pays 1 edge
    assert tight.status == "optimal"
    assert tight.choice in {(0, 0, 1), (1, 0, 0)}
    assert tight.objective == pytest.approx(1 + 1 + 3 + 0.5)
    assert solve_assignment(chain(80.0)).objective == pytest.approx(1 + 3 + 3 + 0.5)
    assert solve_assignment(chain(30.0)).choice == (1, 1, 1)
    assert solve_assignment(chain(29.0)).status == "infeasible"
    assert brute_force(chain(29.0)).status == "infeasible"


def test_integer_bytes_at_capacity_are_exact():
    # loads below 2**40 bytes scale exactly: two big units fill the device to the byte
    big, small = float(2 * 10**11 + 7), float(10**11 + 1)
    memory = [((big,), (small,))] * 4
    problem = AssignmentProblem([(0.0, 1.0)] * 4, (), memory, (2 * big + 2 * small,))
    got = solve_assignment(problem)
    assert got.objective == 2.0 and fits(problem, got.choice)
    assert brute_force(problem).objective == 2.0
    # a device that every plan fits is not constrained at all, however large its numbers
    huge = float(2**60 + 2**8)
    problem = AssignmentProblem([(0.0, 1.0)] * 4, (), [((huge,), (0.0,))] * 4, (4 * huge,))
    assert solve_assignment(problem).choice == (0, 0, 0, 0)


def test_edge_conventions():
    m = ((1.0, 2.0), (4.0, 8.0))
    base = [(0.0, 0.0), (0.0, 0.0)]
    assert evaluate(AssignmentProblem(base, [(0, 0, m)]), (1, 0)) == 8.0  # diagonal only
    assert evaluate(AssignmentProblem(base, [(0, 1, m), (0, 1, m)]), (0, 1)) == 4.0
    assert evaluate(AssignmentProblem(base, [(1, 0, m)]), (0, 1)) == 4.0  # m[choice[1]][..]
    # a reversed parallel edge is merged transposed: u=0 takes 1, v=1 takes 0
    problem = AssignmentProblem(
        [(0.0, 0.0), (0.0, 0.0)], [(0, 1, ((9.0, 9.0), (0.0, 9.0))), (1, 0, ((9.0, 0.0),) * 2)]
    )
    result = solve_assignment(problem)
    assert result.choice == (1, 0) and result.objective == 0.0


def test_single_candidate_units_and_empty_problem():
    problem = AssignmentProblem([(2.0,), (1.0, 5.0)], [(0, 1, ((7.0, 0.0),))])
    assert solve_assignment(problem).choice == (0, 1)
    assert solve_assignment(problem).objective == 7.0
    empty = solve_assignment(AssignmentProblem(()))
    assert empty == AssignmentResult((), 0.0, True, "optimal")


def test_lists_are_normalised_to_tuples():
    problem = AssignmentProblem([[1, 2]], [[0, 0, [[1, 2], [3, 4]]]], [[[5], [6]]], [7])
    assert problem.node_costs == ((1.0, 2.0),)
    assert problem.edges == ((0, 0, ((1.0, 2.0), (3.0, 4.0))),)
    assert problem.memory == (((5.0,), (6.0,)),) and problem.capacity == (7.0,)
    same = AssignmentProblem(
        ((1.0, 2.0),), ((0, 0, ((1.0, 2.0), (3.0, 4.0))),), (((5.0,), (6.0,)),), (7.0,)
    )
    assert problem == same and hash(problem) == hash(same)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"node_costs": [(1.0,), ()]}, "node_costs\\[1\\] is empty"),
        ({"node_costs": [(1.0, -1.0)]}, "finite and >= 0"),
        ({"node_costs": [(math.nan,)]}, "finite and >= 0"),
        ({"node_costs": [(math.inf,)]}, "finite and >= 0"),
        ({"node_costs": [("x",)]}, "must be a number"),
        ({"node_costs": [(1.0,)], "edges": [(0, 1, ((1.0,),))]}, "names unit 1"),
        ({"node_costs": [(1.0,)], "edges": [(0, 0.5, ((1.0,),))]}, "must be an integer"),
        ({"node_costs": [(1.0, 2.0)], "edges": [(0, 0, ((1.0,),))]}, "has 1 rows"),
        ({"node_costs": [(1.0, 2.0)], "edges": [(0, 0, ((1.0,), (2.0,)))]}, "has 1 entries"),
        ({"node_costs": [(1.0,)], "edges": [(0, 0)]}, "must be \\(u, v, cost\\)"),
        ({"node_costs": [(1.0,)], "memory": [((1.0,),)]}, "without capacity"),
        ({"node_costs": [(1.0,)], "capacity": (1.0,)}, "memory has 0 units"),
        ({"node_costs": [(1.0,)], "memory": [((1.0,), (1.0,))], "capacity": (1.0,)}, "2 cand"),
        ({"node_costs": [(1.0,)], "memory": [((1.0, 1.0),)], "capacity": (1.0,)}, "2 entries"),
        ({"node_costs": [(1.0,)], "memory": [((1.0,),)], "capacity": (-1.0,)}, ">= 0"),
    ],
)
def test_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AssignmentProblem(**kwargs)


def test_bad_choice_and_solver_arguments():
    problem = chain(None)
    for bad in [(0, 0), (0, 0, 2), (0, 0, -1)]:
        with pytest.raises(ValueError):
            evaluate(problem, bad)
        with pytest.raises(ValueError, match="hint"):
            solve_assignment(problem, hint=bad)
    with pytest.raises(ValueError, match="time_limit_s"):
        solve_assignment(problem, time_limit_s=0)
    with pytest.raises(ValueError, match="workers"):
        solve_assignment(problem, workers=0)


def test_hint_is_accepted():
    for seed in range(10):
        problem = random_problem(random.Random(1000 + seed))
        exact = brute_force(problem)
        hints = [tuple(0 for _ in problem.node_costs)]
        if exact.choice:
            hints.append(exact.choice)
        for hint in hints:  # the first may not fit memory: still only a hint
            got = solve_assignment(problem, hint=hint)
            assert got.status == exact.status
            if exact.choice:
                assert close(got.objective, exact.objective)


def test_deterministic():
    # many exact ties: every choice of the 6 units costs the same
    tied = AssignmentProblem([(1.0,) * 4] * 6, [(u, u + 1, ((1.0,) * 4,) * 4) for u in range(5)])
    for problem in [tied, random_problem(random.Random(7)), chain(130.0)]:
        runs = {solve_assignment(problem, seed=3) for _ in range(3)}
        assert len(runs) == 1
    runs = {solve_assignment(tied, seed=3, workers=4) for _ in range(3)}
    assert all(r.status == "optimal" and r.objective == 11.0 for r in runs)


def test_scaling_keeps_large_and_tiny_costs_apart():
    # costs spanning 1e-6 .. 1e3 seconds: the tiny difference still decides
    problem = AssignmentProblem(
        [(1000.0, 1000.0), (2e-6, 1e-6)], [(0, 1, ((0.0, 5e-7), (0.0, 0.0)))]
    )
    got = solve_assignment(problem)
    assert got.choice == (1, 1) and close(got.objective, brute_force(problem).objective)


def test_time_limit_without_a_plan_falls_back_on_a_fitting_hint():
    rng = random.Random(0)
    n, k = 40, 4
    nodes = [[rng.uniform(0, 1) for _ in range(k)] for _ in range(n)]
    edges = [
        (u, u + 1, [[rng.uniform(0, 1) for _ in range(k)] for _ in range(k)]) for u in range(n - 1)
    ]
    memory = [[[rng.uniform(0, 10)] for _ in range(k)] for _ in range(n)]
    capacity = (sum(min(row[0] for row in per) for per in memory) + 5,)
    problem = AssignmentProblem(nodes, edges, memory, capacity)
    hint = tuple(min(range(k), key=lambda a, u=u: memory[u][a][0]) for u in range(n))
    quick = solve_assignment(problem, time_limit_s=1e-6)
    assert quick.status in {"unknown", "feasible", "optimal"}
    if quick.status == "unknown":
        assert quick.choice == () and quick.objective == math.inf and not quick.optimal
    hinted = solve_assignment(problem, time_limit_s=1e-6, hint=hint)
    assert hinted.status in {"feasible", "optimal"} and fits(problem, hinted.choice)
    full = solve_assignment(problem)
    assert full.status == "optimal" and full.objective <= hinted.objective + 1e-12
