"""Roofline compute cost: hand-computed cases, the partition rule, the backward rule,
measured overrides, and the efficiency table."""

from __future__ import annotations

from typing import get_args

import pytest

from flexsearch.cost.compute import (
    OpCost,
    Partition,
    Work,
    backward_work,
    forward_work,
    node_dtype,
    op_cost,
    roofline_time,
)
from flexsearch.cost.efficiency import efficiency_from_dict, load_efficiency
from flexsearch.cost.hardware import Cluster, DeviceSpec
from flexsearch.errors import ClusterSpecError
from flexsearch.graph.opgraph import NodeKind, OpNode, TensorMeta

PEAK32, PEAK16, BW = 1e12, 4e12, 1e11


def v(x):
    return {"value": x, "source": "test"}


DEVICE = DeviceSpec.model_validate({
    "name": "test-device",
    "peak_flops": {"float32": v(PEAK32), "bfloat16": v(PEAK16), "float16": v(PEAK16)},
    "memory_bandwidth": v(BW),
    "memory_capacity": v(1e10),
})


def table(flops: float = 1.0, bandwidth: float = 1.0, overrides=None):
    entry = {"flops": v(flops), "bandwidth": v(bandwidth)}
    return efficiency_from_dict({
        "default": {k: entry for k in get_args(NodeKind)},
        "devices": overrides or {},
    })


EXACT = table()


def node(kind="linear", *, flops=0, bwd=0, read=0, written=0, params=0, dtype="float32", name="n") -> OpNode:
    return OpNode(
        name=name, kind=kind, target="t", inputs=(), outputs=(TensorMeta(shape=(1,), dtype=dtype),),
        flops=flops, backward_flops=bwd, bytes_read=read, bytes_written=written, param_bytes=params,
    )


# ------------------------------------------------------------------ roofline


def test_compute_bound_linear():
    # X[1024, 4096] @ W[4096, 4096] in float32
    x, w, y = 1024 * 4096 * 4, 4096 * 4096 * 4, 1024 * 4096 * 4
    n = node(flops=2 * 1024 * 4096 * 4096, bwd=4 * 1024 * 4096 * 4096, read=x + w, written=y, params=w)
    c = op_cost(n, DEVICE, efficiency=EXACT)
    assert c.source == "roofline"
    assert c.forward_s == pytest.approx(2 * 1024 * 4096 * 4096 / PEAK32)  # 34.4 ms > bytes/BW 1.0 ms
    assert c.backward_s == pytest.approx(4 * 1024 * 4096 * 4096 / PEAK32)
    assert c.total_s == pytest.approx(c.forward_s + c.backward_s)


def test_memory_bound_elementwise():
    n = node("elementwise", flops=1_000_000, bwd=1_000_000, read=8_000_000, written=4_000_000, dtype="bfloat16")
    c = op_cost(n, DEVICE, efficiency=table(0.5, 0.8))
    assert c.forward_s == pytest.approx(12e6 / (BW * 0.8))  # vs 1e6 / (4e12 * 0.5)
    assert c.backward_s == pytest.approx(2 * 12e6 / (BW * 0.8))


def test_dtype_selects_the_peak():
    n = node(flops=int(4e12), dtype="bfloat16")
    assert node_dtype(n) == "bfloat16"
    assert op_cost(n, DEVICE, efficiency=EXACT).forward_s == pytest.approx(1.0)
    assert op_cost(n, DEVICE, dtype="float32", efficiency=EXACT).forward_s == pytest.approx(4.0)
    assert node_dtype(node(dtype="int64")) == "float32"


def test_efficiency_factors_apply_per_kind_and_device():
    t = table(0.5, 0.5, overrides={"test-device": {"matmul": {"flops": v(0.25), "bandwidth": v(1.0)}}})
    w = Work(flops=1e12, bytes=0)
    assert roofline_time(w, DEVICE, "float32", "linear", t) == pytest.approx(2.0)
    assert roofline_time(w, DEVICE, "float32", "matmul", t) == pytest.approx(4.0)


def test_placeholders_are_free():
    for kind in ("input", "output", "param"):
        assert op_cost(node(kind, read=10**9, written=10**9), DEVICE) == OpCost(0.0, 0.0, "free")


def test_default_table_on_a_preset():
    h100 = Cluster.preset("dgx-h100").device
    n = node(flops=int(1e15), bwd=int(2e15), dtype="bfloat16")
    eff, _ = load_efficiency().factors("linear", h100.name)
    assert op_cost(n, h100).forward_s == pytest.approx(1e15 / (989.4e12 * eff))


# ------------------------------------------------------------------ partition rule


def test_partition_rule():
    n = node(flops=1600, bwd=3200, read=1000 + 400, written=600, params=400)
    p = Partition(sample=2, attribute=1, parameter=4, reduce=2)
    assert p.tasks == 16
    fw = forward_work(n, p)
    assert fw.flops == pytest.approx(1600 / 16)
    # activations / (s*a*r) + params / (p*r) + output / (s*a*p)
    assert fw.bytes == pytest.approx(1000 / 4 + 400 / 8 + 600 / 8)
    bw = backward_work(n, p)
    assert bw.flops == pytest.approx(3200 / 16)
    assert bw.bytes == pytest.approx(2 * fw.bytes)


def test_partition_by_attribute_splits_activations_not_params():
    n = node(flops=800, read=800 + 200, written=400, params=200)
    fw = forward_work(n, Partition(attribute=4))
    assert fw.bytes == pytest.approx(800 / 4 + 200 + 400 / 4)


def test_lookup_reads_only_gathered_rows():
    # an embedding whose table (param_bytes) is far larger than the rows it read
    emb = node("embedding", read=64 + 4096, written=4096, params=10**9)
    fw = forward_work(emb, Partition(parameter=2))
    assert fw.bytes == pytest.approx((64 + 4096) / 2 + 4096 / 2)


def test_whole_partition_equals_the_node():
    n = node(flops=1234, read=500, written=300, params=100)
    fw = forward_work(n)
    assert (fw.flops, fw.bytes) == (1234, 800)


@pytest.mark.parametrize("bad", [{"sample": 0}, {"reduce": -1}, {"parameter": 1.5}, {"attribute": True}])
def test_partition_degrees_must_be_positive_integers(bad):
    with pytest.raises(ValueError):
        Partition(**bad)


def test_partition_is_hashable():
    assert len({Partition(2, 1, 1, 1), Partition(sample=2)}) == 1


# ------------------------------------------------------------------ measured override


class Table:
    def __init__(self, times):
        self.times = times
        self.calls = []

    def lookup(self, node, partition, device_name, dtype):
        self.calls.append((node.name, partition, device_name, dtype))
        return self.times.get((node.name, partition))


def test_measured_times_override_the_roofline():
    n = node(flops=10**12, name="fc")
    lookup = Table({("fc", Partition(sample=2)): (0.003, 0.007)})
    hit = op_cost(n, DEVICE, Partition(sample=2), measured=lookup, efficiency=EXACT)
    assert hit == OpCost(0.003, 0.007, "measured")
    assert lookup.calls[-1] == ("fc", Partition(sample=2), "test-device", "float32")
    miss = op_cost(n, DEVICE, Partition(sample=4), measured=lookup, efficiency=EXACT)
    assert miss.source == "roofline" and miss.forward_s == pytest.approx(10**12 / 4 / PEAK32)


def test_measured_times_must_be_sane():
    with pytest.raises(ValueError):
        op_cost(node(name="x"), DEVICE, measured=Table({("x", Partition()): (-1.0, 0.0)}))


# ------------------------------------------------------------------ efficiency file


def test_efficiency_file_covers_every_kind_within_bounds():
    t = load_efficiency()
    for kind in get_args(NodeKind):
        f, b = t.factors(kind, "any device")
        assert 0 < f <= 1 and 0 < b <= 1
    cpu = Cluster.preset("cpu").device.name
    assert cpu in t.devices
    assert t.factors("elementwise", cpu) != t.factors("elementwise", "any device")


def test_efficiency_table_rejects_gaps_and_bad_factors():
    entry = {"flops": v(0.5), "bandwidth": v(0.5)}
    with pytest.raises(ClusterSpecError, match="conv"):
        efficiency_from_dict({"default": {k: entry for k in get_args(NodeKind) if k != "conv"}})
    with pytest.raises(ClusterSpecError, match="default.linear.flops.value"):
        efficiency_from_dict({"default": {k: (entry if k != "linear" else {**entry, "flops": v(1.5)}) for k in get_args(NodeKind)}})
