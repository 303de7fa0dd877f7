"""Checkpoints of emitted modules (DCP, original keys): parallel -> original, original ->
parallel, across plans, errors; and examples/train.py under torchrun."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import ROOT

import flexsearch
from flexsearch.emit.checkpoint import load, load_original, save, save_original
from flexsearch.emit.launch import run_ranks
from flexsearch.errors import EmitError
from flexsearch.graph.tracer import trace
from flexsearch.plan import Plan
from flexsearch.strategy.space import Space

SPEC = str(ROOT / "benchmarks/models/mlp.py:mlp_tiny")
WORLD = 2
SOAP = {"net_0": "s1.p2:1", "net_2": "s1.r2:0", "net_4": "s1@1", "net_6": "s2"}
"""Megatron column- then row-wise split, a layer on device 1 alone (rank 0 holds empty
shards of it), then data parallel."""


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out.float(), target)


def make_plans() -> dict[str, Plan]:
    model, x = flexsearch.load_model(SPEC)
    base = flexsearch.plan(model, x, devices=WORLD, cluster="cpu", max_iters=5, precision="fp32")
    sp = Space(trace(model, x), WORLD)

    def configs(want) -> dict[str, str]:
        dec = {u.name: next(c for c in sp.candidates(u) if c.text == want(u.name)) for u in sp.units}
        return {k: v.text for k, v in sp.expand(dec).items()}

    data = base.model_copy(update={"kind": "data", "configs": configs(lambda _: "s2"), "stages": ()})
    return {
        "ddp": data,
        "fsdp": data.model_copy(update={"shard": "zero3"}),
        "soap": base.model_copy(update={"kind": "soap", "configs": configs(SOAP.__getitem__)}),
    }


def _fulls(module) -> dict[str, torch.Tensor | None]:
    """Every parameter, whole (None where this rank holds none of it)."""
    from flexsearch.emit.verify import full

    out = {}
    for name, p in module.named_original_parameters():
        f = full(p.detach())
        out[name] = None if f is None else f.clone()
    return out


def _ranks_job(rank: int, world: int, plans: dict[str, Plan], root: str, perturbed: str,
               others: dict[str, str]) -> dict:
    from flexsearch.emit import parallelize

    model, x = flexsearch.load_model(SPEC)
    target = torch.randn(model(*x).shape, generator=torch.Generator().manual_seed(3))
    out: dict = {"trained": {}, "loaded": {}, "loss": {}, "errors": {}}
    for name, plan in plans.items():  # (a) train one step, save
        module = parallelize(model, plan)
        opt = torch.optim.Adam(module.parameters(), lr=0.01)
        module.train_step(x, target, loss_fn)
        opt.step()
        save(module, os.path.join(root, name))
        out["trained"][name] = _fulls(module)
    for name, plan in plans.items():  # (b) the perturbed original model into each plan
        module = parallelize(model, plan)
        load(module, perturbed)
        out["loaded"][name] = _fulls(module)
        out["loss"][name] = float(module.train_step(x, target, loss_fn))
    fsdp = parallelize(model, plans["fsdp"])  # resharding: a SOAP checkpoint into FSDP
    load(fsdp, os.path.join(root, "soap"))
    out["soap_into_fsdp"] = _fulls(fsdp)
    for what, path in {"missing": os.path.join(root, "nope"), **others}.items():  # (c)
        try:
            load(fsdp, path)
        except EmitError as e:
            out["errors"][what] = str(e)
    return out


def _whole(per_rank: list[dict[str, torch.Tensor | None]]) -> dict[str, torch.Tensor]:
    """Each parameter as the ranks that hold it report it (all of them agreeing)."""
    out: dict[str, torch.Tensor] = {}
    for r in per_rank:
        for k, v in r.items():
            if v is None:
                continue
            if k in out:
                torch.testing.assert_close(v, out[k], msg=lambda m, k=k: f"ranks disagree on {k}: {m}")
            out.setdefault(k, v)
    return out


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    plans = make_plans()
    model, x = flexsearch.load_model(SPEC)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    save_original(model, d / "perturbed")
    cls = type(model)
    save_original(cls(16, 32, 8, 3), d / "fewer_layers")
    save_original(cls(16, 64, 8, 4), d / "wider")
    others = {"keys": str(d / "fewer_layers"), "shapes": str(d / "wider")}
    results = run_ranks(_ranks_job, WORLD, plans, str(d), str(d / "perturbed"), others, timeout_s=180)
    return d, plans, model, x, results


@pytest.mark.parametrize("kind", ["ddp", "fsdp", "soap"])
def test_parallel_checkpoint_loads_into_original(ran, kind):
    d, _, _, _, results = ran
    trained = _whole([r["trained"][kind] for r in results])
    fresh, _ = flexsearch.load_model(SPEC)
    initial = {k: v.clone() for k, v in fresh.state_dict().items()}
    load_original(fresh, d / kind)
    state = fresh.state_dict()
    assert set(state) == set(trained)
    for k, v in state.items():
        torch.testing.assert_close(v, trained[k], rtol=0, atol=0, msg=lambda m, k=k: f"{kind} {k}: {m}")
        assert not torch.equal(v, initial[k]), f"{kind} {k} did not train"


@pytest.mark.parametrize("kind", ["ddp", "fsdp", "soap"])
def test_original_checkpoint_loads_into_parallel(ran, kind):
    _, _, perturbed, x, results = ran
    loaded = _whole([r["loaded"][kind] for r in results])
    want = perturbed.state_dict()
    assert set(loaded) == set(want)
    for k, v in want.items():
        torch.testing.assert_close(loaded[k], v, rtol=0, atol=0, msg=lambda m, k=k: f"{kind} {k}: {m}")
    # the loaded weights are the ones the module computes with
    with torch.no_grad():
        out = perturbed(*x)
    ref = float(loss_fn(out, torch.randn(out.shape, generator=torch.Generator().manual_seed(3))))
    for r in results:
        assert r["loss"][kind] == pytest.approx(ref, rel=1e-5)


def test_checkpoint_reshards_across_plans(ran):
    _, _, _, _, results = ran
    soap = _whole([r["trained"]["soap"] for r in results])
    into_fsdp = _whole([r["soap_into_fsdp"] for r in results])
    assert set(soap) == set(into_fsdp)
    for k in soap:
        torch.testing.assert_close(into_fsdp[k], soap[k], rtol=0, atol=0)


def test_checkpoint_errors(ran, tmp_path):
    _, _, _, _, results = ran
    for r in results:
        errs = r["errors"]
        assert set(errs) == {"missing", "keys", "shapes"}
        assert "does not exist" in errs["missing"]
        assert "lacks 2 key(s)" in errs["keys"] and "net.6.weight" in errs["keys"]
        assert "of shape" in errs["shapes"]
        assert all("\n" not in e for e in errs.values())
    model, _ = flexsearch.load_model(SPEC)
    with pytest.raises(EmitError, match="does not exist"):
        load_original(model, tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(EmitError, match="not a checkpoint"):
        load_original(model, tmp_path / "empty")
    small = type(model)(16, 32, 8, 3)
    with pytest.raises(EmitError, match="has 2 key"):
        load_original(small, ran[0] / "ddp")
    (tmp_path / "file").write_text("")
    with pytest.raises(EmitError, match="is a file"):
        save_original(model, tmp_path / "file")

    class Opaque(torch.nn.Module):  # an emitted module that does not say its original keys
        def train_step(self, inputs, target, loss_fn):
            raise NotImplementedError

    with pytest.raises(EmitError, match="original_state_dict"):
        save(Opaque(), tmp_path / "opaque")


def test_train_example_under_torchrun(tmp_path):
    model, x = flexsearch.load_model(SPEC)
    plan = flexsearch.plan(model, x, devices=WORLD, cluster="cpu", max_iters=20)
    plan.save(tmp_path / "plan.json")
    ck = tmp_path / "ck"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["GLOO_SOCKET_IFNAME"] = env.get("GLOO_SOCKET_IFNAME", "lo")
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORLD),
         str(ROOT / "examples/train.py"), "--plan", str(tmp_path / "plan.json"), "--model", SPEC,
         "--steps", "4", "--checkpoint", str(ck)],
        capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    losses = [float(line.split()[3]) for line in r.stdout.splitlines() if line.startswith("step ")]
    assert len(losses) == 4 and losses[-1] < losses[0], r.stdout
    assert "median step time" in r.stdout
    fresh, _ = flexsearch.load_model(SPEC)
    load_original(fresh, ck)
    assert not torch.equal(fresh.state_dict()["net.0.weight"], model.state_dict()["net.0.weight"])


def test_train_example_user_error_exits_2(tmp_path):
    model, x = flexsearch.load_model(SPEC)
    plan = flexsearch.plan(model, x, devices=WORLD, cluster="cpu", max_iters=5)
    plan.save(tmp_path / "plan.json")
    r = subprocess.run([sys.executable, str(ROOT / "examples/train.py"), "--plan", str(tmp_path / "plan.json"),
                        "--model", SPEC], capture_output=True, text=True, timeout=60, cwd=Path(ROOT))
    assert r.returncode == 2 and "torchrun" in r.stderr
