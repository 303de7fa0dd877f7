"""Models no one here wrote: Hugging Face ``transformers`` models built from configs
(nothing downloaded) and a single-file research GPT are traced, planned, emitted and
verified against the single-process model."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import ROOT

import flexsearch
from flexsearch.cost.hardware import Cluster
from flexsearch.emit.launch import run_ranks
from flexsearch.graph.coupling import sample_coupling
from flexsearch.graph.moe import NOTE as MOE_NOTE
from flexsearch.graph.tracer import trace
from flexsearch.search.planner import EXPORTED_NOTE, plan_graph
from flexsearch.strategy.config import is_source
from flexsearch.strategy.space import Space

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "data"))
from hf_models import MORE_NAMES, NAMES, build  # noqa: E402

DECODERS = ("gpt2", "llama", "mistral", "qwen2", "gemma", "mixtral", "qwen2_moe")
MOE = ("mixtral", "qwen2_moe")


@pytest.fixture(scope="module")
def graphs():
    return {}


def _graph(graphs, name):
    if name not in graphs:
        model, x = build(name)
        graphs[name] = (model, x, trace(model, x))
    return graphs[name]


@pytest.mark.parametrize("name", NAMES)
def test_traces(graphs, name):
    model, _, g = _graph(graphs, name)
    n_params = sum(p.numel() for p in model.parameters())
    assert sum(n.num_params for n in g.nodes) + g.unused_params == n_params
    assert g.flops > 0 and g.backward_flops > g.flops
    cache = [x for x in g.notes if "use_cache = False" in x]
    assert bool(cache) == (name in DECODERS + ("bert", "roberta", "t5", "bart")), g.notes
    assert (MOE_NOTE in g.notes) == (name in MOE)
    assert sample_coupling(g) == ()  # per-sample losses (a mixture-of-experts dispatch's token counts couple nothing)


def test_hugging_face_losses_that_couple_samples_are_found():
    """CLIP's contrastive loss (``return_loss=True``: its image-text logits) and Mixtral's
    load-balancing loss (``output_router_logits=True``: tokens per expert times the mean
    router probability, over the batch), each at the line of the op that couples."""
    vision = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4, image_size=32,
                  patch_size=8)
    text = dict(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=32, bos_token_id=0, eos_token_id=1)
    clip = transformers.CLIPModel(transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=16))
    got = sample_coupling(trace(clip, (torch.randint(0, 99, (4, 8)), torch.randn(4, 3, 32, 32), {"return_loss": True})))
    assert [(c.how, c.source.rsplit("/", 1)[-1].split(":")[0]) for c in got] == [("mixing", "modeling_clip.py")]
    cfg = transformers.MixtralConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, output_router_logits=True, max_position_embeddings=32)
    ids = torch.randint(0, 128, (4, 16))
    got = sample_coupling(trace(transformers.MixtralForCausalLM(cfg), (ids, {"labels": ids})))
    assert [(c.how, c.source.rsplit("/", 1)[-1].split(":")[0]) for c in got] == [("nonlinear", "modeling_mixtral.py")]


def test_moe_experts_cost_their_expected_load(graphs):
    _, _, g = _graph(graphs, "mixtral")
    grouped = [n for n in g.nodes if "grouped_mm" in n.target]
    assert grouped and all(n.kind == "matmul" and n.flops > 0 for n in grouped)
    cfg = graphs["mixtral"][0].config
    rows = 4 * 16 * cfg.num_experts_per_tok  # every token's top-k experts
    up = next(n for n in grouped if n.outputs[0].shape[-1] == 2 * cfg.intermediate_size)
    assert up.flops == 2 * rows * cfg.hidden_size * 2 * cfg.intermediate_size


def test_use_cache_left_alone_when_the_inputs_set_it():
    model, (ids,) = build("gpt2")
    g = trace(model, (ids, {"use_cache": False}))
    assert not g.notes and model.config.use_cache  # the user's config is restored either way


@pytest.mark.parametrize("builder", ["build_model", "explicit_attention", "with_targets"])
def test_single_file_gpt_traces(builder):
    """``B, T, C = x.size()``, the shape assert, ``.transpose().contiguous().view()``
    after attention, the causal-mask buffer, ``(logits, loss)`` and tied weights."""
    import single_file_gpt as sf

    model, x = getattr(sf, builder)()
    g = trace(model, x)
    assert g.unused_params == 0
    assert sum(n.num_params for n in g.nodes) == sum(p.numel() for p in model.parameters())
    if builder == "with_targets":  # the model's own loss is part of the graph, and costed
        assert any("cross_entropy" in n.target or "nll_loss" in n.target for n in g.nodes)


def test_export_traced_models_get_every_plan_kind(graphs):
    """A model only torch.export traces is searched like any other; its SOAP
    configurations use every device (the emitter runs the exported ATen graph on
    DTensor, with no op on a subset of the devices), and the plan says so."""
    _, _, g = _graph(graphs, "bert")
    assert g.via == "export"
    plan = plan_graph(g, Cluster.resolve("cpu", 2), max_iters=0)
    assert EXPORTED_NOTE in plan.notes
    soap = plan_graph(g, Cluster.resolve("cpu", 2), kinds=("soap",), max_iters=50)
    configs = soap.node_configs()
    assert soap.kind == "soap" and all(configs[n.name].s * configs[n.name].t == 2 for n in g.nodes if not is_source(n))
    space = Space(g, 2)
    assert all(c.s * c.t == 2 for u in space.units for c in space.candidates(u))
    assert plan_graph(g, Cluster.resolve("cpu", 4), kinds=("hybrid",), max_iters=0).kind == "hybrid"


def test_a_tensor_passed_twice_is_two_inputs():
    """``labels=input_ids`` (Hugging Face shifts the labels itself): two graph inputs, the
    second named by its keyword, and the same graph as two distinct tensors give."""
    model, (ids,) = build("gpt2")
    g = trace(model, (ids, {"labels": ids}))
    assert g.input_names == ("", "labels")
    assert g.fingerprint == trace(model, (ids, {"labels": ids.clone()})).fingerprint


def _main(out):
    for key in ("logits", "last_hidden_state"):
        if getattr(out, key, None) is not None:
            return out[key] if isinstance(out, dict) else getattr(out, key)
    return out[0] if isinstance(out, (tuple, list)) else out


def _loss(out, target):
    return F.mse_loss(_main(out).float(), target)


def hf_job(rank: int, world: int, cases: list) -> list:
    """On every rank: each (model name, plan) emitted and verified."""
    from flexsearch.emit.verify import verify

    sys.path.insert(0, str(ROOT / "tests"))
    sys.path.insert(0, str(ROOT / "tests" / "data"))
    out = []
    for name, plan in cases:
        if name.startswith("single_file_gpt"):
            import single_file_gpt as sf

            model, x = sf.with_targets()
            if name.endswith("+frozen_tok"):  # its token table (tied to the head) frozen
                model.tok.weight.requires_grad_(False)
            r = verify(model, plan, x)  # the model's own loss: no loss_fn, no target
        elif name.endswith("+labels"):  # a Hugging Face LM on its own loss
            model, (ids,) = build(name.removesuffix("+labels"))
            r = verify(model, plan, (ids, {"labels": ids}))
        elif name.endswith("+padded"):  # the first sequence's second half padded (ignored): uneven shards
            model, (ids,) = build(name.removesuffix("+padded"))
            labels = ids.clone()
            labels[0, ids.shape[1] // 2:] = -100
            r = verify(model, plan, (ids, {"labels": labels}))
        else:
            model, x = build(name)
            torch.manual_seed(1)
            with torch.no_grad():
                args, kwargs = (x[:-1], x[-1]) if isinstance(x[-1], dict) else (x, {})
                y = torch.randn(_main(model(*args, **kwargs)).shape)
            r = verify(model, plan, x, y, _loss)
        out.append((name, plan.kind, plan.shard_params, r["loss"], r["reference_loss"]))
    return out


@pytest.mark.parametrize("part", ["kinds", pytest.param("more", marks=pytest.mark.slow)])
def test_emitted_hf_plans_match_single_process(graphs, part):
    """``kinds``: data parallel (DDP) for a decoder LM; SOAP (the exported ATen graph on
    DTensor) for an MoE; FSDP2 for Llama; a pipeline cut from an exported graph: an
    encoder-decoder with keyword inputs and its embedding tied across stages
    (interleaved: two stages of one rank share it); D-PSGD for a ResNet with BatchNorm
    (local statistics: the reference is the mean of the two half-batch steps). ``more``
    (behind the ``slow`` marker): GPT-2's pipeline on its own loss (``labels``) in the
    last stage; the single-file GPT on its own loss; Llama's SOAP plan fully and
    selectively checkpointed. 2 gloo ranks."""
    import single_file_gpt as sf

    cl = Cluster.resolve("cpu", 2)
    cases = []
    if part == "kinds":
        for name, kind in (("gpt2", "data"), ("llama", "fsdp"), ("t5", "pipeline"), ("mixtral", "soap"),
                           ("resnet", "decentralized")):
            _, _, g = _graph(graphs, name)
            cases.append((name, plan_graph(g, cl, kinds=(kind,), max_iters=0)))
    else:
        model, (ids,) = build("gpt2")
        cases.append(("gpt2+labels", plan_graph(trace(model, (ids, {"labels": ids})), cl, kinds=("pipeline",),
                                                max_iters=0)))
        model, x = sf.with_targets()
        cases.append(("single_file_gpt", flexsearch.plan(model, x, devices=2, cluster="cpu", kinds=["data"],
                                                         max_iters=0, precision="fp32")))
        # SOAP on the exported ATen graph, fully and selectively checkpointed: each unit's ops
        # rerun on DTensor (under selective, its matmuls' outputs cached)
        _, _, g = _graph(graphs, "llama")
        soap = plan_graph(g, cl, kinds=("soap",), max_iters=0)
        cases += [("llama", soap.model_copy(update={"recompute": rc})) for rc in ("full", "selective")]
    results = run_ranks(hf_job, 2, cases, timeout_s=600)
    for rank in results:
        for name, kind, shard, loss, ref in rank:
            assert loss == pytest.approx(ref, rel=1e-5), (name, kind, shard)
    if part == "kinds":
        assert {(c[0], c[1].shard_params) for c in cases} >= {("llama", True), ("gpt2", False)}
        assert [c[1].kind for c in cases if c[0] in ("t5", "mixtral")] == ["pipeline", "soap"]
    else:
        assert [c[1].kind for c in cases] == ["pipeline", "data", "soap", "soap"]


def test_every_unsupported_construct_is_reported_at_once(capsys):
    from flexsearch.cli import main

    assert main(["trace", str(ROOT / "tests/data/branchy.py")]) == 2
    got = capsys.readouterr()
    text = " ".join(got.err.split())
    assert "2 unsupported constructs" in text and "branchy.py:16" in text and "branchy.py:19" in text
    assert "Traceback" not in got.err + got.out


def test_a_model_built_on_meta_traces_through_export():
    """Llama's rotary embedding runs under ``torch.no_grad`` (a higher-order op in the
    exported graph) and creates tensors on the model's device: meta, measured on fake CPU."""
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
        ids = torch.randint(0, 256, (4, 16))
    g = trace(model, (ids,))
    assert g.via == "export" and g.num_params == sum(p.numel() for p in model.parameters())


def test_verify_command(tmp_path, capsys):
    """`flexsearch verify`: exit 0 with the largest differences when the plan computes
    what the model does (here on the model's own loss), 1 when it does not (dropout
    masks drawn per rank), 2 for bad input."""
    from flexsearch.cli import main

    path = tmp_path / "plan.json"
    for spec, code in ((ROOT / "tests/data/single_file_gpt.py:with_targets", 0),
                       (ROOT / "tests/data/dropout_mlp.py", 1)):
        assert main(["plan", str(spec), "--devices", "2", "--cluster", "cpu", "--kind", "data", "--max-iters", "0",
                     "--precision", "fp32", "--out", str(path), "--force"]) == 0
        capsys.readouterr()
        assert main(["verify", str(spec), "--plan", str(path), "--steps", "2"]) == code
        got = capsys.readouterr()
        assert ("model's own loss" in got.out and "relative difference" in got.out) if code == 0 \
            else ("differs" in got.err)
    assert main(["verify", str(ROOT / "tests/data/dropout_mlp.py"), "--plan", str(path), "--ranks", "4"]) == 2
    assert "--ranks 2" in capsys.readouterr().err


def test_batch_statistics_are_a_plan_option(graphs):
    _, _, g = _graph(graphs, "resnet")
    cl = Cluster.resolve("cpu", 2)
    local = plan_graph(g, cl, kinds=("data",), max_iters=0)
    sync = plan_graph(g, cl, kinds=("data",), max_iters=0, batch_norm="sync")
    assert (local.batch_norm, sync.batch_norm) == ("local", "sync")
    assert any("batch statistics per replica" in n for n in local.notes)
    assert any("SyncBatchNorm" in n for n in sync.notes)
    _, _, gpt = _graph(graphs, "gpt2")
    assert not any("batch statistics" in n for n in plan_graph(gpt, cl, kinds=("data",), max_iters=0).notes)


@pytest.mark.slow
def test_every_family_verifies_on_the_planners_choice(graphs):
    """Each family: the planner's own plan, and its best FSDP, SOAP and pipeline plans, on
    2 `cpu` devices, emitted and verified on 2 gloo ranks. Prints the family x kind table."""
    cl = Cluster.resolve("cpu", 2)
    cases = []
    for name in NAMES:
        _, _, g = _graph(graphs, name)
        cases.append((name, plan_graph(g, cl, max_iters=50)))
        for kind in ("fsdp", "soap", "pipeline"):
            cases.append((name, plan_graph(g, cl, kinds=(kind,), max_iters=50 if kind == "soap" else 0)))
    results = run_ranks(hf_job, 2, cases, timeout_s=1800)
    for name, kind, shard, loss, ref in results[0]:
        print(f"{name:<16} {kind + (' (fsdp)' if shard else ''):<22} loss {loss:.6g} reference {ref:.6g}")
    for name, kind, _shard, loss, ref in results[0]:
        assert loss == pytest.approx(ref, rel=1e-5), (name, kind)
    assert {kind for _, kind, *_ in results[0]} >= {"soap", "pipeline"}


@pytest.mark.slow
def test_more_families_trace_plan_and_verify(graphs):
    """Eighteen more families (:data:`hf_models.MORE_NAMES`: Phi, GPT-NeoX, OPT, Gemma 2
    and 3, Qwen3, OLMo 2, StarCoder2, GPT-J, BLOOM, DeBERTa-v2, Swin, DeepSeek-V3's
    latent attention and experts, ...): each traces with every parameter counted, plans
    on 2 `cpu` devices and on 8 `dgx-h100`, and the planner's choice on 2 devices and its
    best SOAP plan, emitted on 2 gloo ranks, compute what the model does."""
    cl, h100 = Cluster.resolve("cpu", 2), Cluster.preset("dgx-h100", 8)
    cases = []
    for name in MORE_NAMES:
        model, _, g = _graph(graphs, name)
        assert sum(n.num_params for n in g.nodes) + g.unused_params == sum(p.numel() for p in model.parameters())
        assert g.flops > 0 and g.backward_flops > g.flops, name
        assert plan_graph(g, h100, max_iters=20).predicted.iteration_time_s > 0
        cases.append((name, plan_graph(g, cl, max_iters=20)))
        cases.append((name, plan_graph(g, cl, kinds=("soap",), max_iters=20)))
    results = run_ranks(hf_job, 2, cases, timeout_s=1800)
    for name, kind, _shard, loss, ref in results[0]:
        print(f"{name:<16} {kind:<22} loss {loss:.6g} reference {ref:.6g}")
    for name, kind, _shard, loss, ref in results[0]:
        assert loss == pytest.approx(ref, rel=1e-5), (name, kind)


@pytest.mark.slow
def test_every_transformer_verifies_a_hybrid_plan(graphs):
    """Pipeline x tensor parallelism (2 stages of 2 devices: DTensor inside the stages,
    interleaved where the planner picks it) for every family with attention, on 4 gloo
    ranks (oversubscribing 2 cores: slower, the same results)."""
    cl = Cluster.resolve("cpu", 4)
    cases = [(name, plan_graph(_graph(graphs, name)[2], cl, kinds=("hybrid",), max_iters=0))
             for name in NAMES if name not in ("resnet", "convnext")]
    results = run_ranks(hf_job, 4, cases, timeout_s=1800)
    for name, kind, _shard, loss, ref in results[0]:
        print(f"{name:<16} {kind:<22} loss {loss:.6g} reference {ref:.6g}")
        assert kind == "hybrid" and loss == pytest.approx(ref, rel=1e-5), name


@pytest.mark.slow
def test_a_constant_made_in_forward_stays_whole_in_a_tensor_parallel_stage():
    """Falcon on its own loss, a hybrid plan (one stage of 2 tensor-parallel devices):
    the exported graph's constant (a tensor built in ``forward``) became a buffer of the
    stage module, and a tensor-parallel stage distributes buffers, so ``lift_fresh_copy``
    ran on a DTensor, which has no rule for it (``NotImplementedError``)."""
    model, (ids,) = build("falcon")
    plan = flexsearch.plan(model, (ids, {"labels": ids}), devices=2, cluster="cpu", kinds=["hybrid"], max_iters=0,
                           precision="fp32")
    assert plan.kind == "hybrid"
    for _, _, _, got, ref in run_ranks(hf_job, 2, [("falcon+labels", plan)])[0]:
        assert got == pytest.approx(ref, rel=1e-5)


def test_the_readme_hugging_face_model_file_traces_with_its_own_loss():
    """``examples/hf_llama.py`` (the README's Hugging Face model file): built on meta, its
    labels the input ids, the loss in the graph."""
    model, inputs = flexsearch.load_model(ROOT / "examples" / "hf_llama.py")
    g = trace(model, inputs)
    assert g.via == "export" and g.input_names == ("", "labels")
    assert any("cross_entropy" in n.target for n in g.nodes)


# ------------------------------------------ Megatron's layout and the collectives it runs


def test_megatron_layout_follows_the_data_flow(graphs):
    """Separate q, k, v projections (Llama, with grouped k/v heads) are all
    column-parallel, the output projection row-parallel; gate and up column, down row."""
    from flexsearch.strategy.recipes import megatron

    g = _graph(graphs, "llama")[2]
    space = Space(g, 4)
    dec = megatron(space, 2)
    attn = next(b for b in g.blocks if b.module_type.endswith("LlamaAttention")).instances[0]
    mlp = next(b for b in g.blocks if b.module_type.endswith("LlamaMLP")).instances[0]
    kinds = [dec[nm].kind for nm in (*attn, *mlp) if g.node(nm).kind == "linear"]
    assert kinds == ["p", "p", "p", "r", "p", "p", "r"]


def comm_job(rank: int, world: int, cases: list) -> list[list[tuple[int, ...]]]:
    """Per (model name, plan): the shapes of the tensors the emitted module's backward
    all-reduces."""
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    class AllReduces(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.shapes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(issubclass(t, DTensor) for t in types):
                return NotImplemented  # DTensor first: its collectives come back here
            if func is torch.ops._c10d_functional.all_reduce.default:
                self.shapes.append(tuple(args[0].shape))
            return func(*args, **(kwargs or {}))

    out = []
    for name, plan in cases:
        module = flexsearch.parallelize(build(name)[0], plan)
        y = _main(module(*build(name)[1]))
        with AllReduces() as seen:
            y.float().pow(2).mean().backward()
        out.append(seen.shapes)
    return out


def test_simulated_input_gradient_all_reduces_are_the_emitted_modules(graphs):
    """Megatron's layout on 2 ranks: the activation-gradient all-reduces the emitted
    module's backward runs are the simulation's input-gradient reductions, one per
    producer for all its readers (Llama: 5, fewer than one per reader); token ids, masks
    and rotary tables get no gradient (GPT-2: 4).
    Parameter-gradient all-reduces (1-D: RMSNorm's weight, whose gradient Llama's
    decomposed norm computes from the partial sums) are left out."""
    from flexsearch.precision import precision
    from flexsearch.search.results import plan_from
    from flexsearch.sim.context import CostContext
    from flexsearch.sim.gradients import merged_reductions
    from flexsearch.sim.predict import predict
    from flexsearch.sim.simulator import Simulator
    from flexsearch.strategy.kinds import Soap
    from flexsearch.strategy.recipes import megatron

    cluster = Cluster.resolve("cpu", 2)
    cases, simulated, per_reader = [], [], []
    for name in ("llama", "gpt2"):
        g = _graph(graphs, name)[2]
        space = Space(g, 2)
        dec = megatron(space, 2)
        configs = space.expand(dec)
        ctx = CostContext(cluster, precision=precision(g.precision))
        frags = [Simulator(g, ctx).fragment(n.name, configs) for n in g.nodes]
        simulated.append(sum(len(r) for r in merged_reductions(frags)))
        per_reader.append(sum(len(f.reductions) for f in frags))
        strategy = Soap(configs, dec)
        cases.append((name, plan_from(g, cluster, strategy, predict(g, strategy, ctx), baselines={},
                                      lower_bound_s=0.0)))
    shapes = run_ranks(comm_job, 2, cases)[0]
    assert [len([s for s in mine if len(s) > 1]) for mine in shapes] == simulated == [5, 4]
    assert per_reader[0] > simulated[0]


def explicit_job(rank: int, world: int, plan) -> tuple[float, float]:
    from flexsearch.emit.verify import verify

    sys.path.insert(0, str(ROOT / "tests" / "data"))
    import single_file_gpt as sf

    model, x = sf.explicit_attention()
    torch.manual_seed(1)
    with torch.no_grad():
        y = torch.randn(_main(model(*x)).shape)
    r = verify(model, plan, x, y, _loss)
    return r["loss"], r["reference_loss"]


def test_megatron_splits_unfused_attention_by_heads():
    """nanoGPT's attention without the fused kernel (``q @ k^T``, the mask buffer,
    softmax, ``@ v``): Megatron's layout splits its products by heads, so the scores
    stay split (replicated, every device would compute every head), and the emitted
    module computes what the model does (2 gloo ranks)."""
    import single_file_gpt as sf

    from flexsearch.search.results import plan_from
    from flexsearch.sim.context import CostContext
    from flexsearch.sim.predict import predict
    from flexsearch.strategy.kinds import Soap
    from flexsearch.strategy.recipes import megatron

    model, x = sf.explicit_attention()
    g = trace(model, x)
    cluster = Cluster.resolve("cpu", 2)
    space = Space(g, 2)
    dec = megatron(space, 2)
    configs = space.expand(dec)
    scores = [n.name for n in g.nodes if n.kind in ("matmul", "softmax") and len(n.outputs[0].shape) == 4]
    assert len(scores) == 3 * 2  # per layer q k^T, softmax, @ v
    assert {(configs[nm].kind, configs[nm].t, configs[nm].dim) for nm in scores} == {("a", 2, 1)}
    strategy = Soap(configs, dec)
    plan = plan_from(g, cluster, strategy, predict(g, strategy, CostContext(cluster)), baselines={},
                     lower_bound_s=0.0)
    for loss, ref in run_ranks(explicit_job, 2, plan):
        assert loss == pytest.approx(ref, rel=1e-5)


def test_exported_casts_split_with_the_batch(graphs):
    """``torch.export`` leaves Llama's RMSNorm casts (``aten.to.dtype``), its mask algebra
    and ``where`` as ATen ops without the ``pointwise`` tag: they are elementwise, so a
    data-parallel configuration splits them by sample like every other op (opaque, they
    ran on the whole batch on every device: an exported RMSNorm model's ZeRO-3 plan was
    predicted 24.2 ms and 3.1 GB against 2.3 ms and 0.4 GB traced by fx)."""
    from flexsearch.strategy.recipes import data_parallel

    g = _graph(graphs, "llama")[2]
    assert g.via == "export"
    casts = [n for n in g.nodes if n.target.startswith(("aten.to.", "aten.__and__", "aten.where"))]
    assert casts and not [n.name for n in casts if n.opaque]
    space = Space(g, 4)
    configs = space.expand(data_parallel(space))
    batch = g.nodes[0].outputs[0].shape[0]  # the token ids
    whole = [n.name for n in g.nodes if n.outputs and n.outputs[0].shape[:1] == (batch,) and configs[n.name].s == 1
             and n.kind not in ("input", "param", "output") and n.outputs[0].dtype.startswith("float")]
    assert not whole  # (the causal mask is built from an arange expanded to the batch: no sample dim, replicated)


def test_a_model_s_own_loss_splits_by_samples_as_data_parallel_runs_it(graphs):
    """Llama on its own loss (``labels``): the exported ``cross_entropy_loss`` is split by
    the samples under data parallelism (each device its replica's loss, as DDP and FSDP
    run it; it ran whole on every device, over the gathered logits: the op-level DDP and
    ZeRO-3 predictions of a 1B Llama on 8 H100s were 109.6 ms and 89.2 ms, now 86.6 ms
    and 66.3 ms, ``benchmarks/hf_models.py``); the simulated loss keeps half its
    log-probabilities per device on 2; and a SOAP plan with that split, emitted on
    DTensor, computes the model's loss and gradients (2 gloo ranks), also when one
    rank's samples hold most of the ignored (padded) labels: each rank sums its samples'
    losses and counts its labels, where DTensor's ``Partial`` average of the shards'
    means was another number (``emit/losses.py``); and so do DDP with the padded
    labels, each rank's mean over the labels all ranks hold (``GlobalMean``), and a
    2-stage pipeline of 2 microbatches, its gradients rescaled by the count over all of
    them (``DeferredMean``), where each rank's or microbatch's own mean failed ``verify``."""
    from flexsearch.precision import precision
    from flexsearch.search.results import plan_from
    from flexsearch.sim.context import CostContext
    from flexsearch.sim.footprint import kept_bytes
    from flexsearch.sim.predict import predict
    from flexsearch.sim.simulator import Simulator
    from flexsearch.strategy.config import Config
    from flexsearch.strategy.kinds import DataParallel, Soap
    from flexsearch.strategy.recipes import data_parallel

    model, (ids,) = build("llama")
    g = trace(model, (ids, {"labels": ids}))
    (loss,) = [n for n in g.nodes if n.kind == "loss"]
    space = Space(g, 2)
    dec = data_parallel(space)
    assert dec[loss.name] == Config(1, "r", 2, 0)
    configs = space.expand(dec)
    cluster = Cluster.resolve("cpu", 2)
    ctx = CostContext(cluster, precision=precision(g.precision))
    frag = Simulator(g, ctx).fragment(loss.name, configs)
    assert frag.activations == {0: kept_bytes(loss) / 2, 1: kept_bytes(loss) / 2}
    assert [t.detail.split()[:2] for t in frag.forward if t.kind == "coll"] == [["partial", "sums"]]
    plans = [plan_from(g, cluster, s, predict(g, s, ctx), baselines={}, lower_bound_s=0.0)
             for s in (Soap(configs, dec), DataParallel(configs, dec))]
    plans.append(flexsearch.plan(model, (ids, {"labels": ids}), devices=2, cluster="cpu", kinds=["pipeline"],
                                 max_iters=0, precision="fp32"))
    cases = [("llama+labels", plans[0]), ("llama+padded", plans[0]), ("llama+padded", plans[1]),
             ("llama+padded", plans[2])]
    for rank in run_ranks(hf_job, 2, cases):
        assert [c[1] for c in rank] == ["soap", "soap", "data", "pipeline"]
        for _, _, _, got, ref in rank:
            assert got == pytest.approx(ref, rel=1e-5)


def test_a_frozen_tied_weight_across_pipeline_stages_is_not_synchronised():
    """Fine-tuning the single-file GPT with its token table (tied to its head) frozen, as
    a 2-stage pipeline: the simulation plans no all-reduce of the tied weight's gradient
    between the stages and the emitted module runs none (it gave the frozen weight a zero
    gradient and all-reduced it, and verify found a gradient the reference has not);
    trained, one of 65,536 bytes (2 gloo ranks)."""
    import single_file_gpt as sf

    from flexsearch.sim.context import CostContext
    from flexsearch.sim.predict import predict

    cl = Cluster.resolve("cpu", 2)
    tied = {}
    for frozen in (False, True):
        model, x = sf.with_targets()
        model.tok.weight.requires_grad_(not frozen)
        g = trace(model, x)
        plan = plan_graph(g, cl, kinds=("pipeline",), max_iters=0)
        sim = predict(g, plan.strategy(g), CostContext(cl))
        tied[frozen] = [t.task.nbytes for t in sim.timeline if t.task.name == "tied weights"]
    assert tied == {False: [65536.0], True: []}
    for rank in run_ranks(hf_job, 2, [("single_file_gpt+frozen_tok", plan)]):
        (_, kind, _, got, ref), = rank
        assert kind == "pipeline" and got == pytest.approx(ref, rel=1e-5)


def own_checkpointing_job(rank: int, world: int, plan) -> tuple[bool, bool, float]:
    from flexsearch.emit import parallelize

    model, x = build("gpt2")
    model.activation_checkpointing_enable()
    module = parallelize(model, plan)
    loss = module.train_step(x, x[0].float(), lambda out, y: out.logits.float().mean())
    return model.is_activation_checkpointing, module.model.is_activation_checkpointing, float(loss)


def test_a_model_s_own_gradient_checkpointing_is_the_plan_s_to_decide():
    """GPT-2 with ``activation_checkpointing_enable()``: the trace names it, and the
    emitted module turns it off (a data plan ran it uncosted, SOAP and pipeline plans
    dropped it silently): the plan's ``recompute`` decides; the user's model keeps it."""
    model, x = build("gpt2")
    model.activation_checkpointing_enable()
    g = trace(model, x)
    assert any("enables its own activation checkpointing" in n for n in g.notes), g.notes
    plan = flexsearch.plan(model, x, devices=2, cluster="cpu", kinds=["data"], max_iters=0, precision="fp32")
    assert plan.recompute == "none"
    for kept, emitted, loss in run_ranks(own_checkpointing_job, 2, plan, timeout_s=300):
        assert kept and not emitted and abs(loss) < float("inf")
