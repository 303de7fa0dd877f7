"""Plans of every emittable kind for the zoo's tiny models, and the per-rank job that
checks an emitted plan against the single-process model (used by test_emit.py)."""

from __future__ import annotations

import random

import torch
import torch.distributed as dist
import torch.nn.functional as F

import flexsearch
from flexsearch.errors import PlanKindError
from flexsearch.graph.tracer import trace
from flexsearch.plan import Plan
from flexsearch.precision import precision as precision_of
from flexsearch.search.baselines import lower_bound
from flexsearch.search.pipeline import SYNC_SCHEDULES
from flexsearch.search.planner import plan_graph
from flexsearch.search.results import plan_from
from flexsearch.sim.context import CostContext
from flexsearch.sim.predict import predict
from flexsearch.strategy.kinds import Soap
from flexsearch.strategy.space import Space

FAMILIES = {
    "mlp": "benchmarks/models/mlp.py:mlp_tiny",
    "gpt": "benchmarks/models/gpt.py:gpt_tiny",
    "cnn": "benchmarks/models/alexnet.py:alexnet_tiny",
    "rnn": "benchmarks/models/rnn.py:rnnlm_tiny",
}
KINDS = ("data", "fsdp", "soap", "gpipe", "1f1b", "interleaved", "hybrid", "dpsgd")


def load(spec: str):
    from conftest import ROOT

    return flexsearch.load_model(f"{ROOT}/{spec}")


def make_plan(spec: str, devices: int, kind: str, seed: int = 0, cluster: str = "cpu",
              precision: str = "fp32") -> Plan | None:
    """A plan of ``kind`` for the model (None when the model has no such plan here):
    the planner's best of that kind (``plan_graph(kinds=...)``; a pipeline kind names
    its schedule), except ``soap``: a random legal SOAP strategy (seeded), to exercise
    the emitter on configurations the search would not pick."""
    model, x = load(spec)
    graph = trace(model, x, precision=precision)
    cl = flexsearch.Cluster.resolve(cluster, devices)
    if kind == "soap":
        space = Space(graph, devices)
        rnd = random.Random(f"{spec}{devices}{seed}")
        decisions = {u.name: rnd.choice(space.candidates(u)) for u in space.units}
        strategy = Soap(space.expand(decisions), decisions)
        ctx = CostContext(cl, precision=precision_of(precision))
        return plan_from(graph, cl, strategy, predict(graph, strategy, ctx), baselines={},
                         lower_bound_s=lower_bound(graph, ctx))
    kinds = {"dpsgd": "decentralized", "hybrid": "hybrid", "data": "data", "fsdp": "fsdp"}.get(kind, "pipeline")
    schedule = {"hybrid": "1f1b"}.get(kind, kind)
    try:
        return plan_graph(graph, cl, kinds=(kinds,), max_iters=0, seed=seed,
                          schedules=(schedule,) if kinds in ("pipeline", "hybrid") else SYNC_SCHEDULES)
    except PlanKindError:
        return None


def with_target(spec: str):
    """The model, its inputs and a fixed random target of its output's shape."""
    model, x = load(spec)
    torch.manual_seed(1)
    with torch.no_grad():
        y = torch.randn(model(*x).shape)
    return model, x, y


def emit_error(model, plan) -> str | None:
    """The ``EmitError`` message that emitting ``plan`` on ``model`` raises on this rank
    (None when it emits)."""
    from flexsearch.emit import parallelize
    from flexsearch.errors import EmitError

    try:
        parallelize(model, plan)
    except EmitError as e:
        return str(e)
    return None


def mse(out, target):
    return F.mse_loss(out.float(), target)


def groups_agree(world: int) -> None:
    """No two process groups share a name: torch names a group by how many groups the
    rank made before it, and its members meet in the store under that name, so ranks
    that made groups in different orders (a group made lazily where only some ranks run)
    reuse a name for different groups and connect to the wrong peers: a hang or, by
    luck, a run."""
    from torch.distributed.distributed_c10d import _world

    mine = {name: tuple(sorted(_world.pg_group_ranks[pg])) for pg, name in _world.pg_names.items()}
    every: list = [None] * world
    dist.all_gather_object(every, mine)
    seen: dict[str, tuple[tuple[int, ...], int]] = {}
    for r, groups in enumerate(every):
        for name, ranks in sorted(groups.items()):
            first, where = seen.setdefault(name, (ranks, r))
            if first != ranks:
                raise AssertionError(f"process group {name!r} is ranks {first} on rank {where} but "
                                     f"ranks {ranks} on rank {r}")


def verified(world: int, spec: str, plan) -> tuple[tuple, object]:
    """On every rank: ``plan`` emitted and verified (loss, gradients, 3 steps), and the
    process groups it made agree across ranks: ``(kind, schedule, loss, reference loss,
    parameters held)`` and the verified module (for a job to inspect what it holds)."""
    from flexsearch.emit.verify import verify

    model, x, y = with_target(spec)
    r = verify(model, plan, x, y, mse)
    groups_agree(world)
    return (plan.kind, plan.schedule, r["loss"], r["reference_loss"], r["params"]), r["module"]


def check_job(rank: int, world: int, spec: str, plans: list) -> list:
    """On every rank: each plan's :func:`verified` figures."""
    return [verified(world, spec, plan)[0] for plan in plans]


def attention_kernels_job(rank: int, world: int, spec: str, plan) -> list[str]:
    """On every rank: the attention kernels a forward of the emitted ``plan`` runs
    (``torch.profiler``'s op names; the second forward: the first also finds output
    shapes on meta tensors)."""
    from flexsearch.emit import parallelize

    model, x, _ = with_target(spec)
    module = parallelize(model, plan)
    module(*x)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        module(*x)
    return sorted({e.name for e in prof.events() if "scaled_dot_product" in e.name})
