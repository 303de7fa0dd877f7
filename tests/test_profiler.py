"""The op profiler: partitioned shapes, measurement, cache keys, resume, bad files."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from flexsearch import ProfileError
from flexsearch.cost.compute import Partition, op_cost
from flexsearch.cost.hardware import Cluster
from flexsearch.cost.op_timing import operand_copies
from flexsearch.cost.profiler import (
    PROFILE_VERSION,
    ProfileDB,
    host_info,
    local_device,
    measure_call,
    partitioned_call,
    partitions_of,
    profile_key,
    profile_model,
)
from flexsearch.graph.calls import ArgTensor
from flexsearch.graph.tracer import trace_calls


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 16)
        self.fc = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 8)

    def forward(self, idx):
        return self.fc2(torch.relu(self.fc(self.emb(idx))))


def traced():
    return trace_calls(Net(), (torch.randint(0, 64, (8, 4)),))


def shapes(call):
    return [a.shape for a in call.args if isinstance(a, ArgTensor)], {n: s for n, s, _, _ in call.module_state}


def test_partitions_of_linear():
    g, _ = traced()
    parts = partitions_of(g.node("fc"))
    assert Partition() in parts
    assert {p.sample for p in parts} == {1, 2, 4, 8}
    assert Partition(attribute=4) in parts and Partition(parameter=8) in parts and Partition(reduce=8) in parts
    assert Partition(attribute=8) not in parts or g.node("fc").outputs[0].shape[1] >= 8


def test_partitioned_shapes_follow_the_rules():
    g, calls = traced()
    fc = g.node("fc")
    assert shapes(partitioned_call(fc, calls["fc"], Partition()))[0] == [(8, 4, 16)]
    assert shapes(partitioned_call(fc, calls["fc"], Partition(sample=2)))[0] == [(4, 4, 16)]
    assert shapes(partitioned_call(fc, calls["fc"], Partition(attribute=2)))[0] == [(8, 2, 16)]
    acts, state = shapes(partitioned_call(fc, calls["fc"], Partition(parameter=4)))
    assert acts == [(8, 4, 16)] and state == {"weight": (8, 16), "bias": (8,)}
    acts, state = shapes(partitioned_call(fc, calls["fc"], Partition(reduce=2)))
    assert acts == [(8, 4, 8)] and state["weight"] == (32, 8) and state["bias"] == (32,)
    emb = g.node("emb")
    _, state = shapes(partitioned_call(emb, calls["emb"], Partition(parameter=2)))
    assert state == {"weight": (64, 8)}  # embedding columns
    _, state = shapes(partitioned_call(emb, calls["emb"], Partition(reduce=2)))
    assert state == {"weight": (32, 16)}  # vocabulary rows


def test_measure_call_runs_partitions():
    g, calls = traced()
    for p in partitions_of(g.node("fc")):
        fwd, bwd = measure_call(partitioned_call(g.node("fc"), calls["fc"], p), repeats=2, warmup=1)
        assert fwd > 0 and bwd > 0


def test_each_timed_call_reads_operands_out_of_the_cache(monkeypatch):
    """Cold measurement: the op's parameters and inputs exist in several copies, used in
    turn (the same weight tensor twice in a row would be in the cache); every copy's
    backward runs after all the copies' forwards. Hot (``cold=False``): one copy."""
    g, calls = traced()
    call = calls["fc"]
    copies = operand_copies(call, torch.device("cpu"))
    assert copies > 1  # a 16 -> 32 Linear is far smaller than any cache
    seen: list[tuple[str, int]] = []
    module = call.module
    module.register_forward_pre_hook(lambda m, a: seen.append(("f", m.weight.data_ptr())))
    real = torch.autograd.grad

    def spy(outputs, inputs, *a, **k):
        seen.append(("b", {t.data_ptr() for t in inputs}))
        return real(outputs, inputs, *a, **k)

    monkeypatch.setattr(torch.autograd, "grad", spy)
    measure_call(call, repeats=3, warmup=1)
    fwd = [p for kind, p in seen if kind == "f"]
    assert len(set(fwd)) == copies >= 4
    assert len(set(fwd[:4])) == 4  # warm-up and timed forwards: never the same weights twice running
    backward = [p for kind, p in seen if kind == "b"]
    # after the sizing forward (fwd[4]), a round's forwards, then its backwards in order
    assert all(fwd[5 + j] in backward[j] for j in range(copies))
    seen.clear()
    measure_call(call, repeats=3, warmup=1, cold=False)
    assert len({p for kind, p in seen if kind == "f"}) == 1
    monkeypatch.setattr("flexsearch.cost.op_timing.cache_bytes", lambda device: 8)  # a cache smaller than the op
    assert operand_copies(call, torch.device("cpu")) == 1  # an op already larger than the cache: one copy


def test_profile_of_an_older_method_is_measured_afresh(tmp_path):
    """Entries timed the old way (hot) are not mixed with cold ones: the file is
    re-measured whole and carries the current version."""
    path = tmp_path / "prof.json"
    model, inputs = Net(), (torch.randint(0, 64, (8, 4)),)
    profile_model(model, inputs, out=path, repeats=1, warmup=0)
    data = ProfileDB.load(path).data
    assert data.version == PROFILE_VERSION
    data.version = PROFILE_VERSION - 1
    path.write_text(data.model_dump_json())
    _, counts = profile_model(model, inputs, out=path, repeats=1, warmup=0)
    assert counts["cached"] == 0 and counts["measured"] == len(data.entries)
    assert ProfileDB.load(path).data.version == PROFILE_VERSION


def test_tf32_profile_is_what_a_tf32_plan_looks_up(tmp_path):
    """Under TF32 the cost model prices fp32 matmul-class ops as ``tf32``: the profiler
    keys them so, and a TF32 context finds the measured times (it priced them from the
    roofline before); other ops keep their fp32 entries."""
    from flexsearch.precision import precision
    from flexsearch.sim.context import CostContext

    path = tmp_path / "prof.json"
    model, inputs = Net(), (torch.randint(0, 64, (8, 4)),)
    db, _ = profile_model(model, inputs, out=path, repeats=1, warmup=0, degrees=(), precision="tf32")
    dtypes = {k.split("|")[-3] for k in db.data.entries}
    assert dtypes == {"tf32", "float32"}  # the Linears, the embedding
    g, _ = traced()
    cl = Cluster.resolve("cpu", 1)
    ctx = CostContext(cl, db.aliased(cl.device.name), precision=precision("tf32"))
    fc = g.node("fc")
    key = profile_key(fc, Partition(), "tf32", local_device(1))
    assert ctx.compute_dtype(fc) == "tf32" and db.get(key) is not None
    assert op_cost(fc, cl.device, Partition(), dtype="tf32", measured=ctx.measured).source == "measured"


def test_cache_hit_and_miss(tmp_path):
    path = tmp_path / "prof.json"
    model, inputs = Net(), (torch.randint(0, 64, (8, 4)),)
    db, counts = profile_model(model, inputs, out=path, repeats=2, warmup=0)
    assert counts["measured"] > 0 and counts["cached"] == 0 and counts["skipped"] == 0
    assert path.exists()
    db2, counts2 = profile_model(model, inputs, out=path, repeats=2, warmup=0)
    assert counts2 == {"measured": 0, "cached": counts["measured"], "skipped": 0}
    assert ProfileDB.load(path).data.host == host_info()  # which machine measured it
    g, _ = traced()
    node = g.node("fc")
    device = local_device(1)
    hit = db2.lookup(node, Partition(sample=2), device, "float32")
    assert hit is not None and hit[0] > 0
    assert db2.lookup(node, Partition(sample=2), "other-device", "float32") is None
    assert db2.lookup(node, Partition(sample=3), device, "float32") is None
    key = profile_key(node, Partition(), "float32", device)
    assert key != profile_key(node, Partition(), "float32", device, torch_version="0.0.1")
    assert key != profile_key(node, Partition(), "bfloat16", device)
    # a bigger layer is a different op: no hit
    g2, _ = trace_calls(nn.Sequential(nn.Linear(16, 64)), (torch.zeros(8, 4, 16),))
    assert db2.lookup(g2.nodes[1], Partition(), device, "float32") is None


def test_mixed_precision_profile_runs_ops_under_autocast(tmp_path, monkeypatch):
    """``precision="bf16-mixed"``: the graph traced under autocast, its lowered ops
    measured under autocast and keyed by their traced dtype (bf16), next to the fp32
    entries of the same model, which a mixed-precision lookup does not take."""
    import flexsearch.cost.profiler as profiler

    seen: list = []
    real = profiler.measure_call

    def spy(call, **kw):
        seen.append(kw.get("autocast"))
        return real(call, **kw)

    monkeypatch.setattr(profiler, "measure_call", spy)
    path = tmp_path / "prof.json"
    model, inputs = Net(), (torch.randint(0, 64, (8, 4)),)
    db, counts = profile_model(model, inputs, out=path, repeats=2, warmup=0, precision="bf16-mixed")
    assert counts["measured"] > 0 and set(seen) == {"bfloat16"}
    g, _ = trace_calls(model, inputs, precision="bf16-mixed")
    fc, device = g.node("fc"), local_device(1)
    assert fc.outputs[0].dtype == "bfloat16"
    assert db.lookup(fc, Partition(), device, "bfloat16") is not None
    assert db.lookup(fc, Partition(), device, "float32") is None  # not profiled in fp32 yet
    seen.clear()
    db, counts = profile_model(model, inputs, out=path, repeats=2, warmup=0)
    assert counts["measured"] > 0 and set(seen) == {None}  # fp32: new entries, no autocast
    assert db.lookup(trace_calls(model, inputs)[0].node("fc"), Partition(), device, "float32") is not None


def test_measured_time_overrides_roofline(tmp_path):
    model, inputs = Net(), (torch.randint(0, 64, (8, 4)),)
    db, _ = profile_model(model, inputs, out=tmp_path / "p.json", repeats=2, warmup=0)
    g, _ = traced()
    cluster = Cluster.preset("cpu", devices=1)
    device = cluster.device.model_copy(update={"name": local_device(1)})
    measured = op_cost(g.node("fc"), device, Partition(sample=2), measured=db)
    assert measured.source == "measured"
    assert (measured.forward_s, measured.backward_s) == db.lookup(g.node("fc"), Partition(sample=2), device.name, "float32")


def test_interrupted_run_resumes(tmp_path):
    path = tmp_path / "prof.json"
    model, inputs = Net(), (torch.randint(0, 64, (8, 4)),)

    def stop_after(done, total, what):
        if done == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        profile_model(model, inputs, out=path, repeats=1, warmup=0, progress=stop_after)
    kept = len(ProfileDB.load(path))
    assert kept == 5
    _, counts = profile_model(model, inputs, out=path, repeats=1, warmup=0)
    assert counts["cached"] == 5 and counts["measured"] > 0


def test_damaged_and_foreign_profile(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ProfileError, match="damaged"):
        ProfileDB.load(bad)
    other = tmp_path / "other.json"
    other.write_text('{"version": 1, "device": "NVIDIA-H200", "entries": {}}')
    with pytest.raises(ProfileError, match="NVIDIA-H200"):
        ProfileDB.load(other, device="cpu-1t")
    newer = tmp_path / "newer.json"
    newer.write_text('{"version": 99, "device": "cpu-1t", "entries": {}}')
    with pytest.raises(ProfileError, match="newer"):
        ProfileDB.load(newer)
