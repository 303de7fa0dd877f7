"""The configuration space: Config text and validation, the emitter rule (legal) and the
candidates that enumerate it, decision units, expansion to followers, data parallel."""

from __future__ import annotations

import functools
import itertools
import math
import sys

import pytest
import torch
from conftest import ROOT, Branchy

sys.path.insert(0, str(ROOT / "benchmarks"))
import zoo  # noqa: E402

from flexsearch import trace  # noqa: E402
from flexsearch.strategy.config import (
    Config,
    candidates,
    follow,
    is_follower,
    is_source,
    legal,
    parse_config,
)
from flexsearch.strategy.space import Space


@functools.cache
def zoo_graph(name: str):
    model, inputs = zoo.build(name)
    return trace(model, inputs)


def every_config(node, devices: int):
    """Every Config constructible with degrees and first in 1..devices and dims of the
    node's first output (the space legal() is the judge of)."""
    rank = len(node.outputs[0].shape) if node.outputs else 0
    for s, t, kind, dim, first in itertools.product(
        range(1, devices + 1), range(1, devices + 1), ("", "a", "p", "r", "x"),
        range(-1, rank), range(devices),
    ):
        try:
            yield Config(s, kind, t, dim, first)
        except ValueError:
            continue


# --------------------------------------------------------------------------- Config text


def test_config_text_examples():
    assert Config().text == "s1"
    assert Config(4).text == "s4"
    assert Config(2, "p", 4, 2).text == "s2.p4:2"
    assert Config(1, "r", 8, 0).text == "s1.r8:0"
    assert Config(2, "x", 2, first=4).text == "s2.x2@4"
    assert str(Config(1, "a", 2, 1, 2)) == "s1.a2:1@2"
    assert parse_config("  s4 ") == Config(4)
    assert parse_config("s1.x2@4") == Config(1, "x", 2, -1, 4)


@pytest.mark.parametrize("name", ["mlp_tiny", "gpt_tiny", "alexnet_tiny", "nmt_tiny", "dlrm_tiny"])
@pytest.mark.parametrize("devices", [1, 4, 6, 8])
def test_config_text_round_trip_for_every_candidate(name, devices):
    g = zoo_graph(name)
    seen = 0
    for node in g.nodes:
        for c in candidates(node, devices):
            assert parse_config(c.text) == c, (node.name, c)
            seen += 1
    assert seen >= len(g.nodes)


@pytest.mark.parametrize(
    "text",
    ["", "4", "s", "S4", "s4.", "s2p2", "s2.q2", "s2.p2:", "s2.p:1", "s-1", "s2@", "s2@-1",
     "s2.p2:1:1", "s2 .p2:1", "p2:1", "s1.x2@1@2", "s1.a2:1.x2"],
)
def test_parse_config_rejects_non_configs(text):
    with pytest.raises(ValueError, match="not a configuration"):
        parse_config(text)


@pytest.mark.parametrize(
    "text", ["s0", "s1.a1:0", "s1.x1", "s2.a2", "s2.p4", "s2.r2", "s2.x2:1", "s1.a0:1"]
)
def test_parse_config_rejects_invalid_configs(text):
    with pytest.raises(ValueError, match="bad config"):
        parse_config(text)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"s": 0},
        {"t": 0},
        {"first": -1},
        {"kind": "a", "t": 1, "dim": 0},  # a kind needs t > 1
        {"kind": "", "t": 2},  # t > 1 needs a kind
        {"kind": "a", "t": 2},  # a/p/r need a dim
        {"kind": "p", "t": 2, "dim": -1},
        {"kind": "r", "t": 4},
        {"kind": "x", "t": 2, "dim": 0},  # x has no dim
        {"dim": 0},  # no split, no dim
    ],
)
def test_config_validation(kwargs):
    with pytest.raises(ValueError, match="bad config"):
        Config(**kwargs)


def test_config_devices():
    c = Config(2, "p", 2, 1, first=4)
    assert c.n == 4
    assert list(c.devices) == [4, 5, 6, 7]
    # t innermost: model-parallel groups are neighbouring devices
    assert [c.device(i, j) for i in range(2) for j in range(2)] == [4, 5, 6, 7]
    assert c.device(1, 0) == 6


# --------------------------------------------------------------------------- emitter rule


@pytest.mark.parametrize(
    "name", ["mlp_tiny", "gpt_tiny", "alexnet_tiny", "nmt_tiny", "dlrm_tiny", "rnntc_tiny",
             "resnet_tiny"]
)
@pytest.mark.parametrize("devices", [4, 6, 8])
def test_candidates_are_exactly_the_legal_configs(name, devices):
    g = zoo_graph(name)
    # one node of every kind (first seen), plus the output and a source
    picked = {}
    for n in g.nodes:
        picked.setdefault((n.kind, n.opaque), n)
    for node in picked.values():
        cands = candidates(node, devices)
        assert list(cands) == sorted(set(cands)), node.name
        assert all(legal(node, c, devices) for c in cands), node.name
        legal_all = {c for c in every_config(node, devices) if legal(node, c, devices)}
        assert legal_all == set(cands), (node.name, sorted(legal_all ^ set(cands)))
        full = candidates(node, devices, full_block_only=True)
        if node.kind in ("input", "output"):
            assert full == cands == (Config(),)
        else:
            assert set(full) == {c for c in cands if c.n == devices}, node.name
        for c in cands:  # structural rules of every legal config
            assert devices % c.n == 0 and c.first % c.n == 0 and c.first + c.n <= devices


def test_sources_and_output_only_whole():
    g = zoo_graph("mlp_tiny")
    for name in ("x", "output"):
        node = g.node(name)
        assert candidates(node, 4) == (Config(),)
        assert legal(node, Config(), 4)
        assert not legal(node, Config(4), 4)
        assert not legal(node, Config(1, "x", 2), 4)
        assert not legal(node, Config(first=1), 4)


def test_blocks_are_aligned():
    lin = zoo_graph("mlp_tiny").node("net_0")  # (16, 32) output, in features 32
    assert legal(lin, Config(2, first=2), 4)
    assert not legal(lin, Config(2, first=1), 4)  # not a multiple of its size
    assert not legal(lin, Config(1, "x", 2, first=3), 4)  # runs past the last device
    assert not legal(lin, Config(4, first=4), 4)
    assert not legal(lin, Config(4), 6)  # a block of 4 does not divide 6 devices
    assert legal(lin, Config(1, "x", 3, first=3), 6)
    assert legal(lin, Config(2), 6) and legal(lin, Config(2, first=4), 6)
    assert legal(lin, Config(first=3), 4)  # a whole op on any one device


def test_degrees_must_divide_dims():
    g = zoo_graph("alexnet_tiny")
    fc = g.node("classifier_4")  # Linear(64, 10), batch 8
    assert legal(fc, Config(1, "p", 2, 1), 4)
    assert not legal(fc, Config(1, "p", 4, 1), 4)  # 10 % 4
    assert legal(fc, Config(8), 8)
    assert legal(fc, Config(8), 16) and legal(fc, Config(8, first=8), 16)  # a half block
    assert legal(fc, Config(8, "x", 2), 16)
    assert not legal(fc, Config(16), 16)  # batch 8
    assert legal(fc, Config(1, "r", 8, 0), 8)
    assert not legal(fc, Config(1, "r", 3, 0), 6) and legal(fc, Config(2, "x", 3), 6)
    # replication needs no dim to divide
    assert legal(fc, Config(1, "x", 6), 6)


def test_conv_spatial_and_channel_rules():
    g = zoo_graph("alexnet_tiny")
    conv = g.node("features_3")  # (8, 16, 8, 8), in channels 8
    assert legal(conv, Config(2), 4)
    assert legal(conv, Config(1, "p", 4, 1), 4)  # out channels: a parameter split
    assert not legal(conv, Config(1, "a", 2, 1), 4)  # channels are not an attribute
    for d in (2, 3):  # spatial splits need a halo: not legal
        assert conv.outputs[0].shape[d] % 2 == 0
        assert not legal(conv, Config(1, "a", 2, d), 4)
        assert not legal(conv, Config(2, "a", 2, d), 4)
    assert not legal(conv, Config(1, "r", 2, 0), 4)  # no reduce split for convs
    assert conv.dims.reduced  # ... even though it has a reduced dim
    # the ReLU after it may be split spatially (pointwise)
    relu = g.node("features_4")
    assert legal(relu, Config(1, "a", 2, 2), 4)
    assert not legal(relu, Config(1, "p", 2, 1), 4)  # no parameters: no parameter split


def test_pool_only_channels():
    pool = zoo_graph("alexnet_tiny").node("features_2")  # (8, 8, 8, 8)
    assert legal(pool, Config(1, "a", 4, 1), 4)
    assert legal(pool, Config(2, "a", 2, 1), 4)
    assert not legal(pool, Config(1, "a", 2, 2), 4)
    assert not legal(pool, Config(1, "a", 2, 3), 4)
    assert not legal(pool, Config(1, "p", 2, 1), 4)


def test_attention_only_heads():
    att = zoo_graph("gpt_tiny").node("scaled_dot_product_attention")  # (8, 4, 32, 16)
    assert att.kind == "attention"
    assert legal(att, Config(1, "a", 4, 1), 4)
    assert legal(att, Config(2, "a", 2, 1), 4)
    assert not legal(att, Config(1, "a", 2, 2), 4)  # a causal mask on a slice of queries
    assert not legal(att, Config(1, "a", 2, 3), 4)
    assert not legal(att, Config(1, "r", 2, 0), 4)
    assert not legal(att, Config(1, "p", 2, 1), 4)
    assert {c.dim for c in candidates(att, 4) if c.kind == "a"} == {1}


def test_reduce_only_linear_embedding_matmul():
    gpt = zoo_graph("gpt_tiny")
    nmt = zoo_graph("nmt_tiny")
    lin = gpt.node("h_0_mlp_c_proj")  # in features 256
    emb = gpt.node("wte")  # vocab 512
    mm = nmt.node("bmm")  # k = 32
    norm = gpt.node("h_0_ln_1")
    conv = zoo_graph("alexnet_tiny").node("features_3")
    for node in (lin, emb, mm):
        assert legal(node, Config(1, "r", 4, 0), 4), node.name
        assert legal(node, Config(2, "r", 2, 0), 4), node.name
        assert not legal(node, Config(1, "r", 4, 1), 4), node.name  # only the first reduced dim
        assert any(c.kind == "r" for c in candidates(node, 4)), node.name
    for node in (norm, conv, gpt.node("scaled_dot_product_attention")):
        assert not any(c.kind == "r" for c in candidates(node, 4)), node.name
    # reduced size must divide: bmm_1 has k = 10
    mm1 = nmt.node("bmm_1")
    assert mm1.dims.reduced[0].size == 10
    assert legal(mm1, Config(1, "r", 2, 0), 4) and not legal(mm1, Config(1, "r", 4, 0), 4)


def test_sample_split_needs_a_sample_dim():
    wpe = zoo_graph("gpt_tiny").node("wpe")  # (32, 64) positions: no batch
    assert not wpe.dims.of_kind("sample")
    assert not legal(wpe, Config(2), 4)
    assert legal(wpe, Config(1, "a", 2, 0), 4)
    assert legal(wpe, Config(1, "p", 4, 1), 4)
    assert all(c.s == 1 for c in candidates(wpe, 4))


def test_rnn_only_sample_or_whole():
    lstm = zoo_graph("rnntc_tiny").node("lstms_0")
    assert lstm.kind == "rnn"
    kinds = {c.kind for c in candidates(lstm, 4)}
    assert kinds <= {"", "x"}
    assert legal(lstm, Config(4), 4) and not legal(lstm, Config(1, "a", 2, 1), 4)


def test_opaque_only_whole():
    lin = zoo_graph("mlp_tiny").node("net_2")
    op = lin.model_copy(update={"opaque": True})
    assert legal(op, Config(), 4) and legal(op, Config(first=3), 4)
    assert legal(op, Config(1, "x", 4), 4) and legal(op, Config(1, "x", 2, first=2), 4)
    assert not legal(op, Config(2), 4)
    assert not legal(op, Config(2, "x", 2), 4)
    assert not legal(op, Config(1, "p", 2, 1), 4)
    assert not legal(op, Config(1, "r", 2, 0), 4)
    assert {c.kind for c in candidates(op, 4)} <= {"", "x"}
    assert all(c.s == 1 for c in candidates(op, 4))
    assert len(candidates(op, 4)) == 4 + 2 + 1


def test_parameter_split_needs_parameters():
    g = zoo_graph("resnet_tiny")
    bn = next(n for n in g.nodes if n.kind == "norm" and n.num_params)  # BatchNorm channels
    (pdim,) = bn.dims.of_kind("parameter")
    c = Config(1, "p", 2, pdim.dim)
    assert legal(bn, c, 4)
    assert not legal(bn.model_copy(update={"num_params": 0}), c, 4)
    # a tied Linear (GPT's lm_head shares wte's weight) owns no parameter: no p split
    lm = zoo_graph("gpt_tiny").node("lm_head")
    assert lm.num_params == 0
    assert not legal(lm, Config(1, "p", 4, 2), 4) and legal(lm, Config(1, "r", 4, 0), 4)


# --------------------------------------------------------------------------- units


def test_gpt_units_share_block_positions():
    g = zoo_graph("gpt_tiny")
    sp = Space(g, 4)
    assert len(sp.units) < len(sp.decision_nodes)
    covered = [nm for u in sp.units for nm in u.nodes]
    assert sorted(covered) == sorted(sp.decision_nodes)  # every decision node, once
    (block,) = g.blocks
    shared = [u for u in sp.units if len(u.nodes) > 1]
    assert shared
    for u in shared:
        assert len(u.nodes) == len(block.instances)
        assert u.name == u.nodes[0]
        pos = {inst.index(nm) for inst, nm in zip(block.instances, u.nodes, strict=True)}
        assert len(pos) == 1  # the same position in every instance
        kinds = {g.node(nm).kind for nm in u.nodes}
        assert len(kinds) == 1
    # ops outside the blocks decide alone
    assert next(u for u in sp.units if u.name == "lm_head").nodes == ("lm_head",)
    assert sp.unit_index["h_0_mlp_c_fc"] == [u.name for u in sp.units].index("h_0_mlp_c_fc")


@pytest.mark.parametrize("name", ["gpt_tiny", "bert_tiny", "inception_tiny"])
def test_units_of_repeated_blocks(name):
    g = zoo_graph(name)
    sp = Space(g, 8)
    assert g.blocks and len(sp.units) < len(sp.decision_nodes)
    position = {nm: (b.id, i) for b in g.blocks for inst in b.instances
                for i, nm in enumerate(inst)}
    for u in sp.units:
        if len(u.nodes) > 1:
            assert len({position[nm] for nm in u.nodes}) == 1, u
            assert len({g.node(nm).output_shapes for nm in u.nodes}) == 1, u
        cands = sp.candidates(u)
        assert Config() in cands and Config(1, "x", 8) in cands
        assert sp.data_parallel(u) in cands
    assert sorted(nm for u in sp.units for nm in u.nodes) == sorted(sp.decision_nodes)


def test_unit_candidates_legal_for_every_node_and_check():
    g = zoo_graph("gpt_tiny")
    sp = Space(g, 4)
    for u in sp.units:
        cands = sp.candidates(u)
        assert cands and cands == sp.candidates(u.name)
        for c in cands:
            assert all(legal(g.node(nm), c, 4) for nm in u.nodes)
            sp.check({u.name: c})
    with pytest.raises(ValueError, match="not a decision"):
        sp.check({"h_1_mlp_c_fc": Config(4)})  # a block member, not the unit's head
    with pytest.raises(ValueError, match="not a decision"):
        sp.check({"nonexistent": Config()})
    with pytest.raises(ValueError, match="not legal for h_0_attn_c_attn"):
        sp.check({"h_0_attn_c_attn": Config(2, first=1)})
    with pytest.raises(ValueError, match="not legal"):
        sp.check({"wpe": Config(4)})


def test_decision_nodes_are_not_sources_or_fed_followers():
    for name in ("gpt_tiny", "alexnet_tiny", "dlrm_tiny"):
        g = zoo_graph(name)
        sp = Space(g, 4)
        for n in g.nodes:
            dec = n.name in sp.decision_nodes
            if is_source(n):
                assert not dec, n.name
            elif is_follower(n) and any(not is_source(g.node(i)) for i in n.inputs):
                assert not dec, n.name
            else:
                assert dec, n.name


def test_iter_decisions_enumerates_the_product():
    g = zoo_graph("mlp_tiny")
    sp = Space(g, 2)
    counts = [len(sp.candidates(u)) for u in sp.units]
    all_dec = list(sp.iter_decisions())
    assert len(all_dec) == math.prod(counts)
    assert len({tuple(sorted((k, v.text) for k, v in d.items())) for d in all_dec}) == len(all_dec)
    assert all(set(d) == {u.name for u in sp.units} for d in all_dec)


# --------------------------------------------------------------------------- expand / follow


@pytest.mark.parametrize("name", ["mlp_tiny", "gpt_tiny", "alexnet_tiny", "nmt_tiny", "dlrm_tiny",
                                  "bert_tiny", "rnntc_tiny"])
@pytest.mark.parametrize("devices", [4, 8])
def test_expand_gives_every_node_a_legal_config(name, devices):
    import random

    g = zoo_graph(name)
    sp = Space(g, devices)
    rng = random.Random(devices)
    decision_sets = [{}, {u.name: sp.data_parallel(u) for u in sp.units}]
    for _ in range(5):
        decision_sets.append({u.name: rng.choice(sp.candidates(u)) for u in sp.units})
    for dec in decision_sets:
        sp.check(dec)
        out = sp.expand(dec)
        assert set(out) == {n.name for n in g.nodes}
        for n in g.nodes:
            assert legal(n, out[n.name], devices), (n.name, out[n.name])
            if is_source(n):
                assert out[n.name] == Config()
        for u in sp.units:
            for nm in u.nodes:
                assert out[nm] == dec.get(u.name, Config())


def test_expand_without_decisions_is_all_on_device_0():
    g = zoo_graph("gpt_tiny")
    out = Space(g, 4).expand({})
    assert set(out.values()) == {Config()}


def _relu_after(decision: Config, devices: int = 4) -> Config:
    g = zoo_graph("mlp_tiny")
    sp = Space(g, devices)
    assert g.node("net_1").kind == "activation" and is_follower(g.node("net_1"))
    return sp.expand({"net_0": decision})["net_1"]


@pytest.mark.parametrize(
    ("producer", "expected"),
    [
        (Config(4), Config(4)),  # the sample split carries over
        (Config(2), Config(2)),
        (Config(2, first=2), Config(2, first=2)),
        (Config(first=3), Config(first=3)),
        (Config(1, "p", 4, 1), Config(1, "a", 4, 1)),  # parameter split -> attribute, same dim
        (Config(2, "p", 2, 1), Config(2, "a", 2, 1)),
        (Config(1, "p", 2, 1, first=2), Config(1, "a", 2, 1, first=2)),
        (Config(2, "x", 2), Config(2, "x", 2)),
        (Config(1, "r", 4, 0), Config(1, "x", 4)),  # partial sums: replicated after the reduce
        (Config(2, "r", 2, 0), Config(2, "x", 2)),
    ],
)
def test_followers_follow(producer, expected):
    assert _relu_after(producer) == expected


def test_followers_follow_through_views_and_chains():
    g = zoo_graph("alexnet_tiny")
    sp = Space(g, 4)
    dec = {u.name: sp.data_parallel(u) for u in sp.units}
    out = sp.expand(dec)
    assert out["features_1"] == out["features_0"] == Config(4)
    assert out["flatten"] == Config(4)  # (8, 16, 2, 2) -> (8, 64): batch maps to batch
    # a parameter split of the conv: the ReLU after it splits the same channels
    dec["features_3"] = Config(1, "p", 4, 1)
    out = sp.expand(dec)
    assert out["features_4"] == Config(1, "a", 4, 1)
    # chains follow transitively in gpt (getitem -> unflatten -> transpose)
    g2 = zoo_graph("gpt_tiny")
    sp2 = Space(g2, 4)
    out2 = sp2.expand({"h_0_attn_c_attn": Config(2, "x", 2)})
    for nm in ("split", "getitem", "unflatten", "transpose"):
        assert out2[nm] == Config(2, "x", 2), nm


def test_follow_unmappable_split_replicates():
    g = zoo_graph("alexnet_tiny")
    # conv p split of channels, then a flatten of (8, 16, 2, 2): channels merge into the
    # flattened dim (the leading dim of a reshape group maps, scaled)
    flat = g.node("flatten")
    pool = g.node("features_12")
    c = follow(flat, pool, Config(1, "a", 4, 1), 4)
    assert legal(flat, c, 4) and c.n == 4 and c.first == 0
    c = follow(flat, pool, Config(2, "a", 2, 1), 4)
    assert legal(flat, c, 4) and c.n == 4 and c.s == 2


def test_data_parallel_uses_all_devices():
    for name, devices in (("mlp_tiny", 4), ("gpt_tiny", 4), ("alexnet_tiny", 8), ("gpt_tiny", 16),
                          ("dlrm_tiny", 4), ("nmt_tiny", 6)):
        g = zoo_graph(name)
        sp = Space(g, devices)
        for u in sp.units:
            c = sp.data_parallel(u)
            assert c.n == devices and c.first == 0, (u.name, c)
            assert c.kind in ("", "x")
            assert c in sp.candidates(u)
            # the largest legal sample split
            assert c.s == max(x.s for x in sp.candidates(u, full_block_only=True)
                              if x.kind in ("", "x"))
        out = sp.expand({u.name: sp.data_parallel(u) for u in sp.units})
        for n in g.nodes:
            if not is_source(n):
                assert out[n.name].n == devices, n.name
    sp = Space(zoo_graph("mlp_tiny"), 4)
    assert sp.data_parallel("net_0") == Config(4)
    assert Space(zoo_graph("gpt_tiny"), 4).data_parallel("wpe") == Config(1, "x", 4)
    assert Space(zoo_graph("gpt_tiny"), 16).data_parallel("wte") == Config(8, "x", 2)  # batch 8


def test_two_branch_model_space():
    g = trace(Branchy(), (torch.randn(8, 16),))
    sp = Space(g, 4)
    assert [u.name for u in sp.units] == ["a", "b", "c", "d"]
    dec = {"a": Config(4), "b": Config(1, "p", 2, 1), "c": Config(1, "p", 2, 1, first=2),
           "d": Config(2, "x", 2)}
    out = sp.expand(dec)
    adds = [n for n in g.nodes if n.kind == "elementwise"]
    assert len(adds) == 1
    # the add follows its first input (the relu after b)
    assert out[adds[0].name] == Config(1, "a", 2, 1)
    for n in g.nodes:
        assert legal(n, out[n.name], 4)


class _Losses(torch.nn.Module):
    """Reductions to a number at the end of a model: which split by the samples."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 8)
        self.register_buffer("w", torch.linspace(0.5, 1.5, 8))

    def forward(self, x, y):
        h = self.fc(x)
        F = torch.nn.functional
        return (F.cross_entropy(h, y), F.cross_entropy(h, y, weight=self.w), F.mse_loss(h, torch.zeros_like(h)),
                h.pow(2).mean(), h.amax(), h.mean(-1))


def test_a_loss_over_the_samples_splits_by_them():
    """A cross-entropy, NLL, sum or mean over the batch into a number has the samples as
    its reduced dim: each device its samples' share (a reduce split), the data-parallel
    configuration; weighted means, the MSE (no DTensor rule) and maxima stay whole."""
    g = trace(_Losses(), (torch.randn(8, 16), torch.randint(0, 8, (8,))))
    ce, weighted, mse, mean, amax, rows = (g.node(nm) for nm in g.nodes[-1].inputs)  # the output's
    assert [n.dims.over_samples for n in (ce, weighted, mse, mean, amax, rows)] == \
        [True, False, False, True, False, False]
    assert ce.dims.reduced[0].size == 8 and rows.dims.of_kind("sample")
    sp = Space(g, 4)
    for node in (ce, mean):
        assert legal(node, Config(1, "r", 4, 0), 4) and legal(node, Config(1, "r", 2, 0), 4)
        assert not legal(node, Config(2, "r", 2, 0), 4)  # no samples left in the output to split
        assert not legal(node, Config(1, "r", 4, 1), 4)
        assert sp.data_parallel(node.name) == Config(1, "r", 4, 0)
    assert not legal(mean, Config(1, "r", 3, 0), 6)  # 8 samples do not split 3 ways
    for node in (weighted, mse, amax):
        assert not any(c.kind == "r" for c in sp.candidates(node.name))
        assert sp.data_parallel(node.name) == Config(1, "x", 4)
    assert sp.data_parallel(rows.name) == Config(4)
