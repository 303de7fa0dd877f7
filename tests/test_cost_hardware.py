"""Hardware specs as data: every preset loads, every number has a source, bad files
give one-line ClusterSpecErrors naming the file and the field, links are stable."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from flexsearch.cost.efficiency import EFFICIENCY_FILE
from flexsearch.cost.hardware import (
    PRESETS_DIR,
    Cluster,
    ClusterSpec,
    Link,
    load_cluster_spec,
    save_cluster_spec,
)
from flexsearch.errors import ClusterSpecError

REQUIRED = {
    "dgx-h100", "dgx-a100", "h200", "flexflow-p100", "flexflow-k80",
    "pipedream-a", "pipedream-b", "commodity", "cpu",
}


def preset_json(name: str) -> dict:
    return json.loads((PRESETS_DIR / f"{name}.json").read_text())


def write(tmp_path: Path, data, name: str = "c.json") -> Path:
    p = tmp_path / name
    p.write_text(data if isinstance(data, str) else json.dumps(data))
    return p


def error_of(path: Path) -> str:
    with pytest.raises(ClusterSpecError) as e:
        Cluster.load(path, devices=8)
    msg = str(e.value)
    assert "\n" not in msg, msg
    assert str(path) in msg, msg
    return msg


# ------------------------------------------------------------------ presets


def test_required_presets_available():
    assert REQUIRED <= set(Cluster.available_presets())


@pytest.mark.parametrize("name", sorted(REQUIRED))
def test_every_preset_loads(name):
    c = Cluster.preset(name, devices=1)
    assert c.devices == 1 and c.num_nodes == 1
    d = c.device
    for dtype in ("float32", "bfloat16", "float16"):
        assert d.peak(dtype) > 0
    assert d.memory_bandwidth.value > 0 and d.memory_capacity.value > 0
    assert c.spec.intra_node.bandwidth.value > 0


def _unsourced_numbers(obj, where=""):
    """Paths of numbers not held as {"value": number, "source": non-empty str}."""
    bad = []
    if isinstance(obj, dict):
        if "value" in obj and isinstance(obj["value"], (int, float)) and not isinstance(obj["value"], bool):
            src = obj.get("source")
            if set(obj) != {"value", "source"} or not isinstance(src, str) or not src.strip():
                bad.append(where)
            return bad
        for k, v in obj.items():
            bad += _unsourced_numbers(v, f"{where}.{k}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            bad += _unsourced_numbers(v, f"{where}[{i}]")
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        bad.append(where)
    return bad


@pytest.mark.parametrize("path", sorted(PRESETS_DIR.glob("*.json")) + [EFFICIENCY_FILE], ids=lambda p: p.name)
def test_every_number_has_a_source(path):
    assert _unsourced_numbers(json.loads(path.read_text())) == []


def test_unsourced_walker_can_fail():
    assert _unsourced_numbers({"a": {"value": 1, "source": " "}, "b": 3, "c": [{"value": 2}]}) == [".a", ".b", ".c[0]"]


def test_cpu_preset_numbers_say_how_they_were_measured():
    data = json.loads((PRESETS_DIR / "cpu.json").read_text())
    for field in (data["intra_node"]["bandwidth"], data["intra_node"]["latency"], data["device"]["peak_flops"]["float32"], data["device"]["memory_bandwidth"]):
        assert "measured by `flexsearch profile --comm`" in field["source"]


def test_headline_numbers():
    h = Cluster.preset("dgx-h100", devices=8)
    assert h.device.peak("bfloat16") == pytest.approx(989.4e12)
    assert h.spec.intra_node.bandwidth.value == 450e9  # 900 GB/s bidirectional, per direction
    assert h.spec.inter_node.bandwidth.value == 50e9  # 400 Gb/s NDR
    assert h.spec.inter_node.nics_per_node.value == 8
    assert Cluster.preset("h200").device.memory_bandwidth.value == 4.8e12
    assert Cluster.preset("dgx-a100").spec.inter_node.bandwidth.value == 25e9
    assert Cluster.preset("pipedream-a").spec.inter_node.bandwidth.value == 10e9 / 8
    assert Cluster.preset("pipedream-b").spec.inter_node.bandwidth.value == 25e9 / 8
    assert Cluster.preset("flexflow-p100").devices == 16
    assert Cluster.preset("flexflow-k80").devices == 64


# ------------------------------------------------------------------ layout


def test_devices_take_as_many_nodes_as_needed():
    c = Cluster.preset("dgx-h100", devices=20)
    assert c.num_nodes == 3 and c.devices == 20
    assert c.node_devices(2) == (16, 17, 18, 19)  # partial last node
    assert [c.node_of(d) for d in (0, 7, 8, 19)] == [0, 0, 1, 2]
    assert c.local_index(19) == 3
    assert Cluster.preset("pipedream-a", devices=5).num_nodes == 2
    with pytest.raises(ValueError):
        c.node_of(20)


def test_too_many_devices_names_the_maximum():
    with pytest.raises(ClusterSpecError) as e:
        Cluster.preset("flexflow-p100", devices=17)
    msg = str(e.value)
    assert "16" in msg and "flexflow-p100" in msg and "\n" not in msg
    assert Cluster.preset("flexflow-p100", devices=16).num_nodes == 4


@pytest.mark.parametrize("bad", [0, -1])
def test_nonpositive_devices(bad):
    with pytest.raises(ClusterSpecError):
        Cluster.preset("dgx-h100", devices=bad)


def test_unknown_preset_lists_the_available_ones():
    with pytest.raises(ClusterSpecError) as e:
        Cluster.preset("dgx-h1000", devices=8)
    msg = str(e.value)
    assert "\n" not in msg and "dgx-h1000" in msg
    for name in REQUIRED:
        assert name in msg


def test_resolve_takes_names_and_paths(tmp_path):
    assert Cluster.resolve("dgx-a100", 4).name == "dgx-a100"
    p = write(tmp_path, preset_json("dgx-a100"))
    assert Cluster.resolve(str(p), 4) == Cluster.preset("dgx-a100", devices=4)


# ------------------------------------------------------------------ links


def test_links_are_unique_and_stable():
    c = Cluster.preset("dgx-h100", devices=16)
    ids = [link.id for link in c.links]
    assert len(ids) == len(set(ids))
    assert ids == [link.id for link in Cluster.preset("dgx-h100", devices=16).links]
    # 16 switch ports x 2 directions + 2 nodes x 8 NICs x 2 directions
    assert len(ids) == 32 + 32
    assert c.link("inter.n1.nic3.tx").bandwidth == 50e9


def test_path_same_node_switch():
    c = Cluster.preset("dgx-h100", devices=16)
    path = c.path(1, 5)
    assert [link.id for link in path] == ["intra.d1.tx", "intra.d5.rx"]
    assert sum(link.latency for link in path) == c.spec.intra_node.latency.value
    assert c.path(3, 3) == ()


def test_path_across_nodes_uses_round_robin_nics():
    c = Cluster.preset("dgx-h100", devices=16)
    assert [link.id for link in c.path(3, 13)] == ["inter.n0.nic3.tx", "inter.n1.nic5.rx"]
    b = Cluster.preset("pipedream-b", devices=16)  # one NIC per server: every device shares it
    assert [link.id for link in b.path(7, 8)] == ["inter.n0.nic0.tx", "inter.n1.nic0.rx"]
    assert [link.id for link in b.path(0, 15)] == ["inter.n0.nic0.tx", "inter.n1.nic0.rx"]


def test_path_on_a_shared_bus():
    c = Cluster.preset("cpu", devices=4)
    assert [link.id for link in c.path(0, 3)] == ["intra.n0.bus"]
    assert c.path(1, 2) == c.path(3, 0)


def test_cluster_is_an_immutable_hashable_value():
    a, b = Cluster.preset("dgx-a100", devices=12), Cluster.preset("dgx-a100", devices=12)
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a != Cluster.preset("dgx-a100", devices=13)
    with pytest.raises(AttributeError):
        a.devices = 3  # type: ignore[misc]
    link = a.links[0]
    assert isinstance(link, Link) and hash(link) == hash(Link(link.id, link.bandwidth, link.latency, link.kind))


def test_peak_falls_back_to_float32():
    d = Cluster.preset("pipedream-b").device
    assert d.peak("tf32") == d.peak("float32")  # Volta has no TF32
    assert d.peak("int64") == d.peak("float32")
    assert Cluster.preset("dgx-a100").device.peak("tf32") == 156e12


# ------------------------------------------------------------------ bad files


def test_missing_field(tmp_path):
    data = preset_json("dgx-h100")
    del data["intra_node"]["bandwidth"]
    msg = error_of(write(tmp_path, data))
    assert "intra_node.bandwidth" in msg and "missing" in msg


def test_unknown_key(tmp_path):
    data = preset_json("dgx-h100")
    data["inter_node"]["bandwith"] = data["inter_node"]["bandwidth"]
    msg = error_of(write(tmp_path, data))
    assert "inter_node.bandwith" in msg and "unknown" in msg


def test_zero_bandwidth(tmp_path):
    data = preset_json("dgx-h100")
    data["inter_node"]["bandwidth"]["value"] = 0
    msg = error_of(write(tmp_path, data))
    assert "inter_node.bandwidth.value" in msg and "> 0" in msg


def test_negative_latency(tmp_path):
    data = preset_json("dgx-h100")
    data["intra_node"]["latency"]["value"] = -1e-6
    msg = error_of(write(tmp_path, data))
    assert "intra_node.latency.value" in msg and ">= 0" in msg


def test_negative_peak(tmp_path):
    data = preset_json("dgx-a100")
    data["device"]["peak_flops"]["bfloat16"]["value"] = -5
    msg = error_of(write(tmp_path, data))
    assert "device.peak_flops.bfloat16.value" in msg


def test_number_without_source(tmp_path):
    data = preset_json("dgx-h100")
    data["device"]["memory_bandwidth"] = 3.35e12
    msg = error_of(write(tmp_path, data))
    assert "device.memory_bandwidth" in msg and "source" in msg


def test_empty_source(tmp_path):
    data = preset_json("dgx-h100")
    data["devices_per_node"]["source"] = "   "
    msg = error_of(write(tmp_path, data))
    assert "devices_per_node.source" in msg


def test_bad_link_kind(tmp_path):
    data = preset_json("dgx-h100")
    data["intra_node"]["topology"] = "ring"
    msg = error_of(write(tmp_path, data))
    assert "intra_node.topology" in msg


def test_not_json(tmp_path):
    msg = error_of(write(tmp_path, '{"name": "x",,}'))
    assert "not valid JSON" in msg and "line 1" in msg


def test_missing_file(tmp_path):
    msg = error_of(tmp_path / "nope.json")
    assert "not found" in msg


def test_multinode_preset_needs_inter_node(tmp_path):
    data = preset_json("dgx-h100")
    del data["inter_node"]
    msg = error_of(write(tmp_path, data))
    assert "inter_node" in msg


# ------------------------------------------------------------------ device files, round trip


def test_device_by_file_name(tmp_path):
    data = preset_json("dgx-a100")
    (tmp_path / "a100.json").write_text(json.dumps(data["device"]))
    data["device"] = "a100"
    c = Cluster.load(write(tmp_path, data), devices=16)
    assert c == Cluster.preset("dgx-a100", devices=16)
    data["device"] = "a200"
    msg = error_of(write(tmp_path, data, "d.json"))
    assert "'device'" in msg and "a200" in msg


def test_save_and_rewrite_round_trip(tmp_path):
    spec = load_cluster_spec(PRESETS_DIR / "cpu.json")
    faster = spec.intra_node.model_copy(
        update={"bandwidth": type(spec.intra_node.bandwidth)(value=5e9, source="measured: flexsearch profile --comm")}
    )
    p = tmp_path / "cpu.json"
    save_cluster_spec(spec.model_copy(update={"intra_node": faster}), p)
    again = load_cluster_spec(p)
    assert isinstance(again, ClusterSpec)
    assert again.intra_node.bandwidth.value == 5e9 and again.device == spec.device
    assert _unsourced_numbers(json.loads(p.read_text())) == []
    # rewriting the file is picked up (the cache keys on the file's stamp)
    data = json.loads(p.read_text())
    data["intra_node"]["bandwidth"]["value"] = 7e9
    p.write_text(json.dumps(data, indent=2))
    assert math.isclose(Cluster.load(p).spec.intra_node.bandwidth.value, 7e9)
