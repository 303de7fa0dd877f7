"""The SOAP search as an assignment problem for the exact solver (Alpa-style ILP).

Each decision unit ``u`` picks one candidate from its configurations that use all
devices, with the model-parallel degree ``t`` at most the devices of one node (the ILP
does not place ops on device subsets nor split a layer across nodes; the MCMC does). Every node's
cost is charged to the unit that decides its layout (its *owner*: itself, or for a
follower the owner of the input it follows). With ``a`` the owner's candidate:

- node term ``T_u(a)``: for every node the unit owns, one task's forward + backward
  compute, its partial-sum all-reduce and its gradient all-reduces, plus the
  transfers of edges between nodes of the same unit;
- edge term ``E_uv(a, b)``: for every graph edge from a node owned by ``v`` to a node
  owned by ``u``, the time of its transfers and gradient collectives run alone (the
  busiest link's total);
- memory ``M_u(a)[d]``: parameters, gradients, optimizer state and activations the
  unit's nodes keep on device ``d`` (inputs received from other devices are not
  counted: the simulator checks the returned plan in full).

The objective ``sum T + sum E`` is the iteration's time with nothing overlapped; the
solution seeds the MCMC, which optimises the simulated (overlapped) time.

**Infeasible before it is built.** Under any configuration a node's kept activations
are split into at most as many pieces as it has partitions, and its parameters into
``t`` of them, so summed over the devices a unit's memory ``M_u(a)`` is at least
``sum over its nodes of (k P + A)`` (``k`` the copies of the parameters' bytes the
optimizer's state makes, ``P`` their bytes, ``A`` the kept activations), whatever ``a``
is; some device holds at least the ``1 / n`` share of the total
(:meth:`AssignmentBuilder.memory_floor`). When that floor is over the capacity no
assignment fits: the problem is infeasible, said without building its costs (GPT-2
XL at batch 512 on 8 H100s: 178 GiB per device at the least, 1.5 s of costs spared).
"""

from __future__ import annotations

import math
import time
from collections import defaultdict

from flexsearch.search.clock import past
from flexsearch.search.ilp import AssignmentProblem, AssignmentResult, solve_assignment
from flexsearch.search.mcmc import sigint_restored
from flexsearch.sim.accounting import param_copies
from flexsearch.sim.context import CostContext
from flexsearch.sim.footprint import kept_bytes
from flexsearch.sim.gradients import without_gradient
from flexsearch.sim.taskgraph import Fragment, edge_tasks, node_tasks
from flexsearch.sim.tasks import Task
from flexsearch.strategy.config import Config, follow, is_source
from flexsearch.strategy.space import Space


def _alone(tasks: list[Task]) -> float:
    """Time of independent tasks run alone: the busiest resource's total."""
    load: dict[int, float] = defaultdict(float)
    for t in tasks:
        for r in t.resources:
            load[r] += t.duration
    return max(load.values(), default=0.0)


class AssignmentBuilder:
    """Builds the :class:`AssignmentProblem` of a space (module docstring)."""

    def __init__(self, space: Space, ctx: CostContext, optimizer: str = "adam"):
        self.space = space
        self.ctx = ctx
        self.state = param_copies(optimizer)
        g = space.graph
        self.units = space.units
        per_node = ctx.cluster.devices_per_node
        self.cands = [
            tuple(c for c in space.candidates(u, full_block_only=True) if c.t <= per_node)
            or space.candidates(u, full_block_only=True)
            for u in self.units
        ]
        unit_of = {nm: i for i, u in enumerate(self.units) for nm in u.nodes}
        self.owner: dict[str, int] = {}
        self.carrier: dict[str, str] = {}
        for n in g.nodes:
            if n.name in unit_of:
                self.owner[n.name] = unit_of[n.name]
            elif not is_source(n):
                c = space.carrier(n).name
                self.carrier[n.name] = c
                self.owner[n.name] = self.owner[c]
        self.owned: dict[int, list[str]] = defaultdict(list)
        for n in g.nodes:
            if n.name in self.owner:
                self.owned[self.owner[n.name]].append(n.name)
        self._edge_memo: dict[tuple, float] = {}
        self._no_grad = without_gradient(g.nodes, g.frozen_params)

    def configs(self, u: int, a: Config) -> dict[str, Config]:
        """Configurations of every node unit ``u`` owns when it takes ``a``."""
        g = self.space.graph
        out: dict[str, Config] = {}
        for nm in self.owned[u]:
            if nm in self.carrier:
                c = self.carrier[nm]
                out[nm] = follow(g.node(nm), g.node(c), out[c], self.space.devices)
            else:
                out[nm] = a
        return out

    def _edge(self, x: str, k: int, cx: Config, y: str, cy: Config) -> float:
        g = self.space.graph
        xn, yn = g.node(x), g.node(y)
        gradient = y not in self._no_grad
        key = (xn.signature, xn.outputs[0].shape, xn.kind, k, cx, yn.signature,
               yn.outputs[0].shape, yn.kind, cy, gradient)
        hit = self._edge_memo.get(key)
        if hit is None:
            frag = Fragment()
            fwd, bwd, _ = edge_tasks(xn, cx, k, yn, cy, self.ctx, frag, gradient=gradient)
            hit = self._edge_memo[key] = _alone(fwd) + _alone(bwd + frag.reductions)  # each edge's, unmerged
        return hit

    def memory_floor(self) -> float:
        """The least memory the fullest device holds under any assignment (module
        docstring): the units' nodes' ``k P + A`` over the ``n`` devices."""
        g = self.space.graph
        total = sum(self.state * g.node(nm).param_bytes + kept_bytes(g.node(nm))
                    for names in self.owned.values() for nm in names)
        return total / self.space.devices

    def problem(self, deadline: float | None = None) -> AssignmentProblem | None:
        """The problem's costs and memory (None: ``deadline``, a ``time.perf_counter()``
        time, passed while they were built: on GPT 1.7B over 32 A100s they take 3-4 s,
        the region intersections of every edge under every pair of candidates)."""
        g = self.space.graph
        devices = self.space.devices
        per_unit = [[self.configs(u, a) for a in self.cands[u]] for u in range(len(self.units))]
        node_costs, memory = [], []
        for u in range(len(self.units)):
            if past(deadline):
                return None
            costs, mems = [], []
            for cfg in per_unit[u]:
                total = 0.0
                mem = [0.0] * devices
                for nm in self.owned[u]:
                    node = g.node(nm)
                    frag = node_tasks(node, cfg[nm], self.ctx, Fragment())
                    fwd, bwd = self.ctx.op_cost(node, cfg[nm])
                    total += fwd + bwd
                    total += sum(t.duration for t in frag.forward + frag.backward if t.kind == "coll")
                    for d, b in frag.params.items():
                        mem[d] += self.state * b
                    for d, b in frag.activations.items():
                        mem[d] += b
                    for k, p in enumerate(node.inputs):
                        if self.owner.get(p) == u:
                            total += self._edge(nm, k, cfg[nm], p, cfg[p])
                costs.append(total)
                mems.append(tuple(mem))
            node_costs.append(tuple(costs))
            memory.append(tuple(mems))
        edges: dict[tuple[int, int], list[list[float]]] = {}
        for n in g.nodes:
            u = self.owner.get(n.name)
            if u is None:
                continue
            for k, p in enumerate(n.inputs):
                v = self.owner.get(p)
                if v is None or v == u:
                    continue
                if past(deadline):
                    return None
                mat = edges.setdefault((v, u), [[0.0] * len(self.cands[u]) for _ in self.cands[v]])
                for b, cv in enumerate(per_unit[v]):
                    for a, cu in enumerate(per_unit[u]):
                        mat[b][a] += self._edge(n.name, k, cu[n.name], p, cv[p])
        cap = self.ctx.cluster.device.memory_capacity.value
        return AssignmentProblem(
            node_costs=tuple(node_costs),
            edges=tuple((v, u, tuple(map(tuple, m))) for (v, u), m in edges.items()),
            memory=tuple(memory),
            capacity=(cap,) * devices,
        )

    def solve(
        self, *, time_limit_s: float = 10.0, seed: int = 0, deterministic: bool = False,
        deadline: float | None = None,
    ) -> tuple[dict[str, Config] | None, AssignmentResult]:
        """Solve; return the decisions (None when nothing fits, or ``deadline`` passed
        while the problem was built: status :data:`CUT_LATE`) and the solver result
        (infeasible without a problem built when :meth:`memory_floor` is over the
        capacity)."""
        if self.memory_floor() > self.ctx.cluster.device.memory_capacity.value:
            return None, AssignmentResult((), math.inf, False, "infeasible")
        problem = self.problem(deadline)
        if problem is None:
            return None, AssignmentResult((), math.inf, False, CUT_LATE)
        res = solve_assignment(problem, time_limit_s=time_limit_s, seed=seed, deterministic=deterministic)
        if not res.choice:
            return None, res
        return {u.name: self.cands[i][a] for i, (u, a) in enumerate(zip(self.units, res.choice, strict=True))}, res


SKIPPED_LATE = "skipped: past the budget"
"""The ILP's status when the budget was spent before it started."""
CUT_LATE = "cut: the budget ran out while its costs were built"
"""The ILP's status when the budget ran out before its problem was built."""


def ilp_seed(space: Space, ctx: CostContext, optimizer: str, limit_s: float, seed: int,
             deterministic: bool, deadline: float | None = None) -> tuple[dict[str, Config] | None, str]:
    """The planner's step 4 (:mod:`flexsearch.search.planner`): the exact solver's assignment (None when it found
    none) and its status; ``deterministic`` limits the solver by deterministic time, so
    runs without a seconds budget are reproducible. Started past ``deadline`` (a
    ``time.perf_counter()`` time: a worker that ran the pipeline search first), it
    skips; else its problem's build and the solver stop at the deadline too."""
    if past(deadline):
        return None, SKIPPED_LATE
    if deadline is not None:
        limit_s = max(0.0, min(limit_s, deadline - time.perf_counter()))
    with sigint_restored():  # CP-SAT would leave Ctrl-C killing the process
        dec, res = AssignmentBuilder(space, ctx, optimizer).solve(time_limit_s=limit_s, seed=seed,
                                                                  deterministic=deterministic, deadline=deadline)
    return dec, res.status
