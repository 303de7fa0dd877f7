"""Every zoo model traces: exact parameter count, FLOPs equal FlopCounterMode over the
whole forward (within 1%), one graph node per standard layer."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from conftest import ROOT, reference_flops

sys.path.insert(0, str(ROOT / "benchmarks"))
from zoo import ZOO  # noqa: E402

from flexsearch import load_model, trace  # noqa: E402

SLOW = ("gnmt16", "gpt3_175b")
"""The largest of a builder's entries (gnmt8 and GPT-2 XL trace the same code), behind
the ``slow`` marker for the default suite's time."""


@pytest.mark.parametrize("entry", [pytest.param(e, marks=pytest.mark.slow) if e.name in SLOW else e for e in ZOO],
                         ids=[e.name for e in ZOO])
def test_zoo_model_traces(entry):
    model, inputs = load_model(entry.abs_spec)
    graph = trace(model, inputs, name=entry.spec)
    assert graph.num_params == sum(p.numel() for p in model.parameters())
    assert graph.unused_params == 0
    ref = reference_flops(model, inputs)
    assert ref > 0
    assert abs(graph.flops - ref) <= 0.01 * ref
    assert graph.nodes[0].kind == "input" and graph.nodes[-1].kind == "output"
    first = graph.nodes[0].outputs[0].shape[0]
    assert first == entry.batch
    # every op that owns parameters says how it can be split, or is explicitly opaque
    for n in graph.nodes:
        if n.num_params:
            assert n.dims.output or n.opaque, n.name


def test_repeated_blocks_in_transformers():
    from zoo import entries

    for e in entries(family="gpt") + entries(family="bert"):
        if e.size == "large":
            continue
        model, inputs = load_model(e.abs_spec)
        g = trace(model, inputs)
        assert g.blocks, e.name
        biggest = max(g.blocks, key=lambda b: len(b.instances))
        assert len(biggest.instances) == sum(1 for _ in biggest.modules)
        assert len(biggest.instances) >= 2


def test_path_is_absolute():
    assert Path(ZOO[0].abs_spec.rsplit(":", 1)[0]).is_absolute()
