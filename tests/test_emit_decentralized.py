"""Decentralized plans: D-PSGD on 4 gloo ranks (:mod:`flexsearch.emit.decentralized`).

- Consensus: with zero gradients, gossip shrinks the consensus distance at least by
  ``beta = ||W - 11^T/n||_2`` per step (ring, exponential), one-peer exponential
  averages exactly in log2(4) = 2 steps, the models are exactly the products of the
  mixing matrices applied to the initial ones (a float32 + float64 model on the
  exponential graph: one exchange per dtype), and the average never moves.
- Training: D-PSGD on a ring trains an MLP to within 5% of the loss of centralized SGD
  (one process, the whole global batch, same learning rate and data order).
- Quadratic: ``f_i(x) = 0.5 mean ||A_i x - b_i||^2`` with different data per rank; every
  rank's iterate equals a float64 reference of the D-PSGD recurrence, and the average of
  the models tracks gradient descent on ``f = mean_i f_i`` within a bound derived from
  the measured consensus distances (see :func:`test_average_tracks_sgd_on_a_quadratic`).
- Errors: a topology of the wrong size, an unknown topology name, custom edges naming a
  device that does not exist, no topology: one-line :class:`EmitError`.

One spawn per job (process start-up dominates; results are cached per module);
process groups time out after 60 s.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from flexsearch.cost.hardware import Cluster
from flexsearch.emit.launch import run_ranks
from flexsearch.graph.tracer import trace
from flexsearch.plan import Plan, Predicted
from flexsearch.search.planner import graph_inputs

WORLD = 4
PG_TIMEOUT_S = 60


class TinyMLP(nn.Module):
    def __init__(self, d_in: int = 8, hidden: int = 32):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


class MixedMLP(TinyMLP):
    """TinyMLP with a float64 head: two parameter groups (dtypes), exchanged separately."""

    def __init__(self):
        super().__init__()
        self.fc2.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)).double()).float()


def make_plan(model: nn.Module, x: torch.Tensor, topology: str | None, devices: int = WORLD,
              edges: tuple = ()) -> Plan:
    graph = trace(model, (x,))
    return Plan(model=graph.model, graph_fingerprint=graph.fingerprint, kind="decentralized", devices=devices,
                cluster=Cluster.resolve("cpu", devices).spec,
                predicted=Predicted(iteration_time_s=0.0, peak_memory_bytes=0.0), lower_bound_s=0.0,
                baselines={}, inputs=graph_inputs(graph), topology=topology, topology_edges=edges)


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def half_sq(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return 0.5 * ((out - target) ** 2).sum(dim=-1).mean()


def zero_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out * 0.0).sum()


def flat(module: nn.Module) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()]).double().numpy()


_CACHE: dict = {}


def cached(key: str, job, *args):
    if key not in _CACHE:
        _CACHE[key] = run_ranks(job, WORLD, *args, timeout_s=240, pg_timeout_s=PG_TIMEOUT_S)
    return _CACHE[key]


def beta(w: np.ndarray) -> float:
    n = w.shape[0]
    return float(np.linalg.norm(w - np.full((n, n), 1.0 / n), 2))


def topo(name: str):
    from flexsearch.strategy.topology import build

    return build(name, WORLD)


# -- consensus -----------------------------------------------------------------------

CONSENSUS = {"ring": 6, "exponential": 6, "one_peer_exponential": 4}
"""Topology -> gossip steps run with zero gradients."""
MODELS = {"exponential": MixedMLP}
"""Topology -> the model gossiped on it (default TinyMLP)."""


def consensus_job(rank: int, world: int, plans: dict[str, Plan]) -> dict:
    from flexsearch.emit import parallelize

    x = torch.zeros(8, 8)
    out = {}
    for name, plan in plans.items():
        torch.manual_seed(rank)  # different models on every rank: construction broadcasts rank 0's
        model = MODELS.get(name, TinyMLP)()
        m = parallelize(model, plan)
        start = m.consensus_distance()
        same_as_caller = bool(np.array_equal(flat(m.model), flat(model)))
        torch.manual_seed(100 + rank)
        with torch.no_grad():
            for p in m.parameters():
                p.add_(torch.randn_like(p))
        x0 = flat(m.model)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        dists, losses = [m.consensus_distance()], []
        for _ in range(CONSENSUS[name]):
            opt.zero_grad()
            losses.append(float(m.train_step((x,), torch.zeros(8, 1), zero_loss)))
            opt.step()
            dists.append(m.consensus_distance())
        avg = m.average_parameters()
        xk = flat(m.model)
        out[name] = dict(start=start, same_as_caller=same_as_caller, x0=x0, xk=xk, dists=dists, losses=losses,
                         avg=torch.cat([t.reshape(-1) for t in avg.values()]).double().numpy(),
                         iteration=m.iteration)
    return out


def _consensus() -> list[dict]:
    plans = {name: make_plan(MODELS.get(name, TinyMLP)(), torch.zeros(8, 8), name) for name in CONSENSUS}
    return cached("consensus", consensus_job, plans)


def test_ranks_start_from_rank_0s_model() -> None:
    res = _consensus()
    for name in CONSENSUS:
        assert all(r[name]["start"] == 0.0 for r in res), name
        assert res[0][name]["same_as_caller"] and not res[1][name]["same_as_caller"], name


@pytest.mark.parametrize("name", ["ring", "exponential"])
def test_gossip_contracts_at_the_spectral_rate(name: str) -> None:
    res = _consensus()
    t = topo(name)
    b = beta(t.matrix(0))
    assert b == pytest.approx(1.0 - t.spectral_gap, abs=1e-9)
    assert b == pytest.approx(1.0 / 3.0, abs=1e-9)  # n = 4: ring with weights 1/3; 2 / (1 + log2 4) for exponential
    dists = res[0][name]["dists"]
    assert all(r[name]["dists"] == pytest.approx(dists, rel=1e-9) for r in res)  # a collective: one value
    assert dists[0] > 1.0
    for k, d in enumerate(dists):
        assert d <= b ** k * dists[0] * (1 + 1e-5) + 1e-6, (k, d, b ** k * dists[0])
    # both graphs are circulant (normal W) with every nontrivial |eigenvalue| = 1/3 at n = 4:
    # the bound is attained, so the measured rate is the predicted one, not merely below it
    for k in range(1, len(dists)):
        assert dists[k] == pytest.approx(b ** k * dists[0], rel=1e-3), k


@pytest.mark.parametrize("name", list(CONSENSUS))
def test_gossip_applies_the_mixing_matrices(name: str) -> None:
    """Every rank's model after k steps is row i of ``W_{k-1} ... W_0 X_0``; the average
    (what SGD would see) never moves."""
    res = _consensus()
    t = topo(name)
    x = np.stack([r[name]["x0"] for r in res])
    for step in range(CONSENSUS[name]):
        x = t.matrix(step) @ x
    got = np.stack([r[name]["xk"] for r in res])
    np.testing.assert_allclose(got, x, rtol=1e-5, atol=1e-5)
    mean0 = np.stack([r[name]["x0"] for r in res]).mean(0)
    for r in res:
        np.testing.assert_allclose(r[name]["avg"], mean0, rtol=1e-5, atol=1e-6)
        assert r[name]["iteration"] == CONSENSUS[name]
        assert r[name]["losses"] == [0.0] * CONSENSUS[name]


def test_one_peer_exponential_averages_exactly_in_log2_n_steps() -> None:
    res = _consensus()
    t = topo("one_peer_exponential")
    assert t.period == 2
    dists = res[0]["one_peer_exponential"]["dists"]
    assert dists[1] > 0.1 * dists[0]  # one step is not enough
    assert dists[2] <= 1e-6 * dists[0] and dists[4] <= 1e-6 * dists[0], dists
    mean0 = np.stack([r["one_peer_exponential"]["x0"] for r in res]).mean(0)
    for r in res:
        np.testing.assert_allclose(r["one_peer_exponential"]["xk"], mean0, rtol=1e-5, atol=1e-6)


# -- training ------------------------------------------------------------------------

TRAIN = dict(steps=150, batch=32, lr=0.1, d_in=8)


def regression_data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Training batches (steps x batch) and an evaluation set: targets from a random
    teacher network (8 -> 16 tanh -> 1) plus noise on the training targets."""
    g = torch.Generator().manual_seed(seed)
    steps, batch, d = TRAIN["steps"], TRAIN["batch"], TRAIN["d_in"]
    w1 = 1.5 * torch.randn(d, 16, generator=g) / math.sqrt(d)
    w2 = torch.randn(16, 1, generator=g) / 4

    def teacher(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ w1) @ w2

    xs = torch.randn(steps, batch, d, generator=g)
    ys = teacher(xs) + 0.05 * torch.randn(steps, batch, 1, generator=g)
    xe = torch.randn(512, d, generator=g)
    return xs, ys, xe, teacher(xe)


def train_job(rank: int, world: int, plan: Plan) -> dict:
    from flexsearch.emit import parallelize

    xs, ys, xe, ye = regression_data()
    torch.manual_seed(0)
    m = parallelize(TinyMLP(TRAIN["d_in"]), plan)
    opt = torch.optim.SGD(m.parameters(), lr=TRAIN["lr"])
    for t in range(TRAIN["steps"]):
        opt.zero_grad()
        m.train_step((xs[t],), ys[t], mse)
        opt.step()
    avg = m.average_parameters()
    with torch.no_grad():
        eval_loss = float(mse(torch.func.functional_call(m.model, avg, (xe,)), ye))
    return dict(eval_loss=eval_loss, consensus=m.consensus_distance())


def centralized() -> tuple[float, float]:
    """(initial, final) evaluation loss of single-process SGD on the whole global batches."""
    xs, ys, xe, ye = regression_data()
    torch.manual_seed(0)
    model = TinyMLP(TRAIN["d_in"])
    with torch.no_grad():
        initial = float(mse(model(xe), ye))
    opt = torch.optim.SGD(model.parameters(), lr=TRAIN["lr"])
    for t in range(TRAIN["steps"]):
        opt.zero_grad()
        mse(model(xs[t]), ys[t]).backward()
        opt.step()
    with torch.no_grad():
        return initial, float(mse(model(xe), ye))


def test_dpsgd_trains_like_centralized_sgd() -> None:
    plan = make_plan(TinyMLP(TRAIN["d_in"]), torch.zeros(TRAIN["batch"], TRAIN["d_in"]), "ring")
    res = cached("train", train_job, plan)
    initial, central = centralized()
    assert central < 0.3 * initial, (initial, central)  # the task is learnt, so the comparison means something
    got = res[0]["eval_loss"]
    assert all(r["eval_loss"] == pytest.approx(got, rel=1e-6) for r in res)  # every rank evaluates the average
    assert abs(got - central) <= 0.05 * central, (got, central)
    assert res[0]["consensus"] > 0.0  # the ranks' models differ: this is not all-reduce in disguise


# -- quadratic -----------------------------------------------------------------------

QUAD = dict(d=6, rows=8, steps=150, lr=0.01)
"""lr: the tracking tolerance below is O(lr^2) per step against O(lr) of motion, so a
small lr makes it tight (2-3% of the distance travelled here)."""
QUAD_TOPOLOGIES = ("ring", "one_peer_exponential")


def quadratic_data() -> tuple[torch.Tensor, torch.Tensor]:
    """Rank r's rows: scaled and shifted differently, fitted to a different x*_r."""
    g = torch.Generator().manual_seed(3)
    d, m = QUAD["d"], QUAD["rows"]
    a = torch.cat([(1.0 + 0.5 * r) * torch.randn(m, d, generator=g) + 0.3 * r for r in range(WORLD)])
    b = torch.cat([a[r * m:(r + 1) * m] @ torch.randn(d, 1, generator=g) for r in range(WORLD)])
    return a / 4.0, b / 4.0


def quadratic_job(rank: int, world: int, plans: dict[str, Plan]) -> dict:
    from flexsearch.emit import parallelize

    a, b = quadratic_data()
    out = {}
    for name, plan in plans.items():
        torch.manual_seed(0)
        m = parallelize(nn.Linear(QUAD["d"], 1, bias=False), plan)
        opt = torch.optim.SGD(m.parameters(), lr=QUAD["lr"])
        xs, dists, losses = [flat(m.model)], [m.consensus_distance()], []
        for _ in range(QUAD["steps"]):
            opt.zero_grad()
            losses.append(float(m.train_step((a,), b, half_sq)))
            opt.step()
            xs.append(flat(m.model))
            dists.append(m.consensus_distance())
        out[name] = dict(xs=np.stack(xs), dists=dists, losses=losses)
    return out


def _quadratic() -> list[dict]:
    a, _b = quadratic_data()
    model = nn.Linear(QUAD["d"], 1, bias=False)
    return cached("quadratic", quadratic_job, {n: make_plan(model, a, n) for n in QUAD_TOPOLOGIES})


def _local(a: np.ndarray, b: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per rank (H_i, c_i) with grad f_i(x) = H_i x - c_i."""
    m = QUAD["rows"]
    out = []
    for r in range(WORLD):
        ar, br = a[r * m:(r + 1) * m], b[r * m:(r + 1) * m, 0]
        out.append((ar.T @ ar / m, ar.T @ br / m))
    return out


@pytest.mark.parametrize("name", QUAD_TOPOLOGIES)
def test_dpsgd_iterates_follow_the_recurrence(name: str) -> None:
    """Every rank's iterate is the float64 reference ``x_i <- sum_j W_ij x_j - lr grad
    f_i(x_i)`` (the gradient at the pre-averaging model) to float32 accuracy, and the
    returned loss is the mean of the ranks' local losses."""
    res = _quadratic()
    a, b = (t.double().numpy() for t in quadratic_data())
    local, lr, t = _local(a, b), QUAD["lr"], topo(name)
    x = np.stack([res[r][name]["xs"][0] for r in range(WORLD)])
    for k in range(QUAD["steps"]):
        loss = np.mean([0.5 * (h @ xi - 2 * c) @ xi for (h, c), xi in zip(local, x, strict=True)])
        m = QUAD["rows"]
        loss += np.mean([0.5 * b[r * m:(r + 1) * m, 0] @ b[r * m:(r + 1) * m, 0] / m for r in range(WORLD)])
        assert res[0][name]["losses"][k] == pytest.approx(loss, rel=1e-4), k
        grads = np.stack([h @ xi - c for (h, c), xi in zip(local, x, strict=True)])
        x = t.matrix(k) @ x - lr * grads
        got = np.stack([res[r][name]["xs"][k + 1] for r in range(WORLD)])
        np.testing.assert_allclose(got, x, rtol=1e-4, atol=1e-5, err_msg=f"step {k + 1}")


@pytest.mark.parametrize("name", QUAD_TOPOLOGIES)
def test_average_tracks_sgd_on_a_quadratic(name: str) -> None:
    """``xbar_k`` (the mean of the ranks' models) against gradient descent ``y_k`` on
    ``f = mean_i f_i`` from the same start, with the same learning rate.

    Mixing preserves the average (W doubly stochastic), so
    ``xbar_{k+1} = xbar_k - lr mean_i grad f_i(x_i)``, and on a quadratic
    ``mean_i grad f_i(x_i) = grad f(xbar) + mean_i (H_i - H)(x_i - xbar)``. Hence
    ``e_{k+1} = (I - lr H) e_k - lr mean_i (H_i - H)(x_i - xbar_k)`` for
    ``e = xbar - y``; with ``lr <= 2 / ||H||`` the first factor does not expand, and by
    Cauchy-Schwarz ``||e_K|| <= lr * max_i ||H_i - H||_2 * sum_{k<K} c_k`` where ``c_k``
    is the measured consensus distance before step k. That is the tolerance (plus 1e-5
    for float32); it is asserted to be under 5% of the distance SGD travels, so the
    test is not vacuous."""
    res = _quadratic()
    a, b = (t.double().numpy() for t in quadratic_data())
    local, lr = _local(a, b), QUAD["lr"]
    hs = [h for h, _c in local]
    h_mean, c_mean = sum(hs) / WORLD, sum(c for _h, c in local) / WORLD
    assert lr <= 2.0 / np.linalg.norm(h_mean, 2)
    delta = max(np.linalg.norm(h - h_mean, 2) for h in hs)
    xbar = np.mean([res[r][name]["xs"] for r in range(WORLD)], axis=0)
    dists = res[0][name]["dists"]
    y = xbar[0].copy()
    y0 = y.copy()
    for k in range(QUAD["steps"]):
        y = y - lr * (h_mean @ y - c_mean)
        bound = lr * delta * sum(dists[:k + 1]) + 1e-5
        assert np.linalg.norm(xbar[k + 1] - y) <= bound, (k, np.linalg.norm(xbar[k + 1] - y), bound)
    assert max(dists) > 1e-3  # the ranks disagree (different data): the tracking is not trivial
    assert lr * delta * sum(dists) < 0.05 * np.linalg.norm(y - y0), (lr * delta * sum(dists), np.linalg.norm(y - y0))


# -- errors --------------------------------------------------------------------------


def error_job(rank: int, world: int, plan: Plan) -> list[str]:
    from flexsearch.emit import parallelize
    from flexsearch.emit.decentralized import DecentralizedModule
    from flexsearch.emit.runtime import Runtime
    from flexsearch.errors import EmitError
    from flexsearch.strategy.topology import build

    msgs = []
    attempts = [
        lambda: DecentralizedModule(TinyMLP(), build("ring", 2 * world), Runtime(plan)),
        lambda: parallelize(TinyMLP(), plan.model_copy(update={"topology": "hypercube9"})),
        lambda: parallelize(TinyMLP(), plan.model_copy(update={"topology": "custom",
                                                                "topology_edges": ((0, 1), (1, 7))})),
        lambda: parallelize(TinyMLP(), plan.model_copy(update={"topology": None})),
    ]
    for attempt in attempts:
        try:
            attempt()
            msgs.append("no error")
        except EmitError as e:
            msgs.append(str(e))
    return msgs


def test_decentralized_errors_are_one_line_and_typed() -> None:
    plan = make_plan(TinyMLP(), torch.zeros(8, 8), "ring")
    msgs = cached("errors", error_job, plan)[0]
    assert "8 nodes but the process group has 4 ranks" in msgs[0], msgs[0]
    assert "hypercube9" in msgs[1], msgs[1]
    assert "custom" in msgs[2] and "7" in msgs[2], msgs[2]
    assert "cannot run 'decentralized' plans without" in msgs[3], msgs[3]
    assert all("\n" not in m for m in msgs), msgs
