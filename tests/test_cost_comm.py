"""Alpha-beta communication cost: hand-computed formulas per algorithm, link sharing,
algorithm choice, and monotonicity in bytes and group size."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flexsearch.cost import comm
from flexsearch.cost.comm import (
    ALGORITHMS,
    all_gather,
    all_reduce,
    all_to_all,
    broadcast,
    collective,
    exchange,
    p2p_time,
    parameter_server,
    reduce_scatter,
)
from flexsearch.cost.hardware import Cluster, ClusterSpec

A, B = 1e-6, 1e9  # intra-node latency and bandwidth of the test cluster
A2, B2 = 1e-4, 1e8  # inter-node (NIC) latency and bandwidth
M = 1e6


def v(x):
    return {"value": x, "source": "test"}


def make(devices: int, per_node: int, *, topology: str = "switch", nics: int = 1) -> Cluster:
    spec = ClusterSpec.model_validate({
        "name": "test",
        "device": {
            "name": "test-device",
            "peak_flops": {"float32": v(1e12), "bfloat16": v(2e12), "float16": v(2e12)},
            "memory_bandwidth": v(1e11),
            "memory_capacity": v(1e10),
        },
        "devices_per_node": v(per_node),
        "intra_node": {"kind": "nvlink", "topology": topology, "bandwidth": v(B), "latency": v(A)},
        "inter_node": {"kind": "ethernet", "bandwidth": v(B2), "latency": v(A2), "nics_per_node": v(nics)},
    })
    return Cluster.from_spec(spec, devices)


ONE_NODE = make(8, 8)


def g(n: int) -> tuple[int, ...]:
    return tuple(range(n))


# ------------------------------------------------------------------ single node, switch


def test_ring_all_reduce_formula():
    r = all_reduce(ONE_NODE, g(4), M, algorithm="ring")
    assert r.algorithm == "ring"
    assert r.time_s == pytest.approx(2 * 3 * A + 2 * 3 / 4 * M / B)


@pytest.mark.parametrize("fn", [all_gather, reduce_scatter])
def test_ring_all_gather_and_reduce_scatter_are_half(fn):
    r = fn(ONE_NODE, g(4), M, algorithm="ring")
    assert r.time_s == pytest.approx(3 * A + 3 / 4 * M / B)
    assert r.time_s == pytest.approx(all_reduce(ONE_NODE, g(4), M, algorithm="ring").time_s / 2)


def test_tree_all_reduce_formula():
    r = all_reduce(ONE_NODE, g(8), M, algorithm="tree")
    assert r.time_s == pytest.approx(2 * 3 * A + 2 * M / B)  # 2 log2(n) alpha + 2 M/B


@pytest.mark.parametrize("n, rounds", [(8, 3), (5, 3), (2, 1)])
def test_tree_all_gather_formula(n, rounds):
    r = all_gather(ONE_NODE, g(n), M, algorithm="tree")
    assert r.time_s == pytest.approx(rounds * A + (n - 1) / n * M / B)


def test_broadcast_formulas():
    assert broadcast(ONE_NODE, g(4), M, algorithm="ring").time_s == pytest.approx(3 * A + M / B)
    # pipelined binary tree: depth 2, the root feeds two children
    assert broadcast(ONE_NODE, g(4), M, algorithm="tree").time_s == pytest.approx(2 * A + 2 * M / B)
    r = broadcast(ONE_NODE, (2, 5, 6), M, root=5, algorithm="ring")
    assert r.time_s == pytest.approx(2 * A + M / B)
    with pytest.raises(ValueError):
        broadcast(ONE_NODE, (2, 5), M, root=7)


def test_all_to_all_direct_formula():
    r = all_to_all(ONE_NODE, g(4), M, algorithm="direct")
    assert r.time_s == pytest.approx(3 * A + 3 / 4 * M / B)
    with pytest.raises(ValueError):
        all_to_all(ONE_NODE, g(4), M, algorithm="ring")


def test_shared_bus_serialises_the_ring():
    bus = make(4, 4, topology="bus")
    r = all_reduce(bus, g(4), M, algorithm="ring")
    # every step puts 4 chunks of M/4 on the one bus
    assert r.time_s == pytest.approx(2 * 3 * (A + M / B))
    assert [link.id for link in r.links] == ["intra.n0.bus"]
    assert r.loads[0][1] == pytest.approx(2 * 3 * M)


def test_ring_loads_every_port():
    r = all_reduce(ONE_NODE, g(4), M, algorithm="ring")
    ids = {link.id: b for link, b in r.loads}
    assert set(ids) == {f"intra.d{d}.{x}" for d in range(4) for x in ("tx", "rx")}
    assert ids["intra.d0.tx"] == pytest.approx(2 * 3 / 4 * M)


# ------------------------------------------------------------------ p2p, exchange, PS


def test_p2p_time():
    c = make(8, 4)
    assert p2p_time(c, 0, 3, M) == pytest.approx(A + M / B)
    assert p2p_time(c, 0, 5, M) == pytest.approx(A2 + M / B2)
    assert p2p_time(c, 2, 2, M) == 0.0
    assert p2p_time(c, 0, 1, 0) == 0.0


def test_exchange_gossip_ring():
    n = 6
    sends = [(i, (i + 1) % n, M) for i in range(n)] + [(i, (i - 1) % n, M) for i in range(n)]
    r = exchange(ONE_NODE, sends)
    assert r.time_s == pytest.approx(A + 2 * M / B)  # alpha + d M / B with degree 2


def test_parameter_server_one_and_sharded():
    c = make(6, 6)
    one = parameter_server(c, (1, 2, 3, 4), 0, M)
    assert one.algorithm == "ps"
    assert one.time_s == pytest.approx(2 * A + 2 * 4 * M / B)
    sharded = parameter_server(c, (2, 3, 4, 5), (0, 1), M)
    assert sharded.algorithm == "ps-sharded"
    assert sharded.time_s == pytest.approx(2 * A + 2 * 4 * M / (2 * B))
    assert sharded.time_s < one.time_s


def test_trivial_cases_cost_nothing():
    for op in ALGORITHMS:
        r = collective(op, ONE_NODE, (3,), M)
        assert (r.time_s, r.algorithm, r.loads) == (0.0, "none", ())
        assert collective(op, ONE_NODE, g(4), 0).time_s == 0.0


def test_bad_arguments():
    with pytest.raises(ValueError):
        all_reduce(ONE_NODE, (0, 0), M)
    with pytest.raises(ValueError):
        all_reduce(ONE_NODE, (0, 8), M)
    with pytest.raises(ValueError):
        all_reduce(ONE_NODE, (), M)
    with pytest.raises(ValueError):
        all_reduce(ONE_NODE, g(2), -1)
    with pytest.raises(ValueError):
        all_reduce(ONE_NODE, g(2), M, algorithm="butterfly")
    with pytest.raises(ValueError):
        collective("gather", ONE_NODE, g(2), M)


# ------------------------------------------------------------------ several nodes


def test_hierarchical_formula_and_beats_flat_ring_on_slow_network():
    c = make(8, 4)  # 2 nodes x 4, one slow NIC per node
    hier = all_reduce(c, g(8), M, algorithm="hierarchical")
    intra = 3 * (A + (M / 4) / B)  # reduce-scatter (and all-gather) inside a node
    # 4 shard rings of 2 nodes, 2 steps; all 4 shards leave through the one NIC
    across = 2 * (A2 + 4 * (M / 8) / B2)
    assert hier.time_s == pytest.approx(2 * intra + across)
    ring = all_reduce(c, g(8), M, algorithm="ring")
    assert ring.time_s == pytest.approx(14 * (A2 + (M / 8) / B2))
    assert hier.time_s < ring.time_s
    best = all_reduce(c, g(8), M)
    assert best.algorithm == "hierarchical" and best.time_s == hier.time_s


def test_hierarchical_wins_on_a_real_preset():
    c = Cluster.preset("pipedream-b", devices=16)
    best = all_reduce(c, g(16), 100e6)
    assert best.algorithm == "hierarchical"
    assert best.time_s < all_reduce(c, g(16), 100e6, algorithm="ring").time_s


def test_ring_channels_spread_over_nics():
    one_nic = all_reduce(make(8, 4, nics=1), g(8), M, algorithm="ring")
    four = all_reduce(make(8, 4, nics=4), g(8), M, algorithm="ring")
    # 4 channels, each with 1/4 of the data, leave every node through 4 different NICs
    assert four.time_s == pytest.approx(14 * (A2 + (M / 32) / B2))
    assert four.time_s < one_nic.time_s
    nic_tx = sorted(link.id for link in four.links if link.id.endswith(".tx") and "nic" in link.id)
    assert nic_tx == [f"inter.n{k}.nic{j}.tx" for k in (0, 1) for j in range(4)]


def test_hierarchical_needs_equal_nodes():
    c = make(8, 4)
    uneven = (0, 1, 2, 4)
    with pytest.raises(ValueError, match="same number"):
        all_reduce(c, uneven, M, algorithm="hierarchical")
    assert all_reduce(c, uneven, M).algorithm in ("ring", "tree")
    # broadcast's hierarchical form works on any group
    assert broadcast(c, uneven, M, algorithm="hierarchical").time_s > 0


def test_hierarchical_all_gather_formula():
    c = make(8, 4)
    r = all_gather(c, g(8), M, algorithm="hierarchical")
    across = 1 * (A2 + 4 * (M / 8) / B2)  # k-1 = 1 step, 4 positions share a NIC
    inside = 3 * (A + (M / 4) / B)
    assert r.time_s == pytest.approx(across + inside)


def test_hierarchical_all_to_all_formula():
    c = make(8, 4)
    r = all_to_all(c, g(8), M, algorithm="hierarchical")
    inside = 3 * A + 3 * (M / 4) / B  # each device sends M/4 to 3 local peers
    across = 1 * A2 + 4 * (M / 2) / B2  # 4 devices each send M/2 through the one NIC
    assert r.time_s == pytest.approx(inside + across)


def test_result_is_a_frozen_value():
    r = all_reduce(ONE_NODE, g(4), M)
    with pytest.raises(AttributeError):
        r.time_s = 0.0  # type: ignore[misc]
    assert r == all_reduce(ONE_NODE, g(4), M)


# ------------------------------------------------------------------ properties

PRESETS = [("dgx-h100", 16), ("pipedream-a", 8), ("cpu", 4), ("commodity", 6), ("flexflow-p100", 16)]
OPS = sorted(ALGORITHMS)


@st.composite
def group_and_cluster(draw):
    name, n = draw(st.sampled_from(PRESETS))
    c = Cluster.preset(name, devices=n)
    group = draw(st.sets(st.integers(0, n - 1), min_size=1, max_size=n))
    return c, tuple(sorted(group))


@settings(max_examples=60, deadline=None)
@given(group_and_cluster(), st.sampled_from(OPS), st.floats(0, 1e10), st.floats(0, 1e10))
def test_monotonic_in_bytes(cg, op, m1, m2):
    c, group = cg
    lo, hi = sorted((m1, m2))
    assert collective(op, c, group, lo).time_s <= collective(op, c, group, hi).time_s
    for algorithm in ALGORITHMS[op]:
        try:
            a = collective(op, c, group, lo, algorithm=algorithm).time_s
        except ValueError:
            continue
        assert a <= collective(op, c, group, hi, algorithm=algorithm).time_s


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from(["dgx-h100", "dgx-a100", "pipedream-a", "pipedream-b", "cpu", "flexflow-k80"]),
    st.sampled_from(OPS),
    st.integers(1, 8),
    st.integers(1, 8),
    st.floats(1.0, 1e10),
    st.booleans(),
)
def test_monotonic_in_group_size(name, op, a, b, nbytes, whole_nodes):
    """Growing a group (within one node, or by whole nodes) never makes it cheaper.
    (A lopsided group, say 8 + 1 devices, can cost more than 16: its one device
    on the second node is the bottleneck; that is the physics, not a bug.)"""
    per_node = Cluster.preset(name, devices=1).devices_per_node
    a, b = sorted((a, b))
    if whole_nodes:
        cap = Cluster.preset(name).spec.max_devices or 8 * per_node
        a, b = min(a * per_node, cap), min(b * per_node, cap)
    else:
        a, b = min(a, per_node), min(b, per_node)
    c = Cluster.preset(name, devices=b)
    small = collective(op, c, g(a), nbytes).time_s
    large = collective(op, c, g(b), nbytes).time_s
    assert small <= large * (1 + 1e-12)


def test_shape_cache_is_bounded():
    assert comm._cached_shape.cache_info().maxsize is not None
