"""Models that couple the samples of their batch (:mod:`flexsearch.graph.coupling`): found
where they do, at the op that does, and nowhere else; a plan that splits the batch says
so, and it is true: on 2 gloo ranks such a data-parallel plan computes another loss,
the SOAP plan the model's."""

from __future__ import annotations

import sys

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import zoo  # noqa: E402

import flexsearch
from flexsearch.emit.launch import run_ranks
from flexsearch.graph.coupling import sample_coupling
from flexsearch.model_files import load_model

SPECS = {name: str(ROOT / f"tests/data/contrastive.py:{name}") for name in ("two_towers", "routed", "per_sample")}


def _graph(name):
    model, inputs = load_model(SPECS[name])
    return flexsearch.trace(model, inputs)


def test_the_op_that_couples_samples_is_found():
    clip = sample_coupling(_graph("two_towers"))
    assert [(c.node, c.how) for c in clip] == [("matmul", "mixing")]
    assert clip[0].source.endswith("contrastive.py:21") and "every sample of its input `t`" in clip[0].text
    balance = sample_coupling(_graph("routed"))
    assert [(c.node, c.how) for c in balance] == [("mul", "nonlinear")] and "a product of two" in balance[0].why
    assert sample_coupling(_graph("per_sample")) == ()  # a mean loss plus a scaled mean: linear


@pytest.mark.parametrize("name", ["gpt_tiny", "resnet_tiny", "bert_tiny", "dlrm_tiny", "rnnlm_tiny"])
def test_per_sample_models_couple_nothing(name):
    model, inputs = zoo.build(zoo.get(name))
    assert sample_coupling(flexsearch.trace(model, inputs)) == ()


def test_plans_that_split_the_batch_say_so():
    for name, coupled in (("two_towers", True), ("routed", True), ("per_sample", False)):
        model, inputs = load_model(SPECS[name])
        for kinds, split in ((["data"], True), (["pipeline"], True), (["soap"], False)):
            plan = flexsearch.plan(model, inputs, devices=2, cluster="cpu", kinds=kinds, max_iters=0)
            said = [n for n in plan.notes if n.startswith("the model couples the samples of its batch")]
            assert bool(said) == (coupled and split), (name, kinds, plan.notes)
            if said:
                assert f"This {plan.kind} plan computes that over each replica's" in said[0]


def verify_job(rank: int, world: int, spec: str, plans: list) -> list:
    """Per plan: None when it computes what the model does (3 steps), else the mismatch."""
    from flexsearch.emit.verify import verify

    out = []
    for plan in plans:
        model, inputs = load_model(spec)
        try:
            verify(model, plan, inputs)
            out.append(None)
        except AssertionError as e:
            out.append(str(e))
    return out


@pytest.mark.parametrize("name", [pytest.param("two_towers", marks=pytest.mark.slow), "routed"])
def test_a_data_plan_changes_a_coupled_loss_and_a_soap_plan_does_not(name):
    model, inputs = load_model(SPECS[name])
    plans = [flexsearch.plan(model, inputs, devices=2, cluster="cpu", kinds=[k], max_iters=0)
             for k in ("data", "soap")]
    got = run_ranks(verify_job, 2, SPECS[name], plans, timeout_s=300)
    for rank in got:
        assert rank[0] is not None and "differs" in rank[0], rank[0]  # the loss (CLIP's), or gradients
        assert rank[1] is None, rank[1]
