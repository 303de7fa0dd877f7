"""The tracer on hand-written models: shapes, FLOPs, params, SOAP dims, blocks, fallbacks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import reference_flops
from pydantic import ValidationError
from torch import nn

import flexsearch
from flexsearch import OpGraph, TraceError, trace
from flexsearch.graph.saved import storage
from flexsearch.graph.tracer import trace_calls


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.heads = heads

    def forward(self, x):
        b, t, c = x.size()
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).contiguous().view(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self, layers=3, d=32, heads=4, vocab=100, seq=16) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.h = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied, as GPT-2

    def forward(self, idx):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for blk in self.h:
            x = blk(x)
        return self.head(self.ln_f(x))


def gpt_inputs(batch=4, seq=16):
    return (torch.randint(0, 100, (batch, seq)),)


def test_gpt_params_flops_and_tied_weights():
    model = TinyGPT()
    g = trace(model, gpt_inputs())
    assert g.via == "fx"
    assert g.num_params == sum(p.numel() for p in model.parameters())
    assert g.unused_params == 0
    assert g.flops == reference_flops(model, gpt_inputs())
    assert g.backward_flops >= g.flops  # backward of a matmul costs two
    head = g.node("head")
    assert head.params == ("wte.weight",) and head.num_params == 0  # owned by wte
    assert g.node("wte").num_params == 100 * 32


def test_soap_dims_of_standard_layers():
    g = trace(TinyGPT(), gpt_inputs())
    qkv = g.node("h_0_qkv")
    assert qkv.kind == "linear"
    assert [(d.dim, d.kind) for d in qkv.dims.output] == [(0, "sample"), (1, "attribute"), (2, "parameter")]
    assert [(r.name, r.size, r.parameter) for r in qkv.dims.reduced] == [("in_features", 32, True)]
    ln = g.node("h_0_ln1")
    assert ln.kind == "norm" and [d.dim for d in ln.dims.output] == [0, 1]
    att = next(n for n in g.nodes if n.kind == "attention")
    assert [(d.dim, d.kind) for d in att.dims.output] == [(0, "sample"), (1, "attribute"), (2, "attribute")]
    assert att.flops > 0  # counted through the math backend
    emb = g.node("wte")
    assert emb.kind == "embedding" and emb.dims.reduced[0].name == "vocab"
    assert emb.bytes_read < 100 * 32 * 4  # a lookup does not read the whole table
    pos = g.node("wpe")  # positions carry no batch
    assert all(d.kind != "sample" for d in pos.dims.output)


class TimmAttention(nn.Module):
    """timm's ViT attention: ``qkv.reshape(B, N, 3, heads, d).permute(2, 0, 3, 1, 4)``
    (permute's dims as separate arguments), then a sequence-first transpose."""

    def __init__(self):
        super().__init__()
        self.qkv, self.proj = nn.Linear(16, 48), nn.Linear(16, 16)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, 4, 4).permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, c)
        return self.proj(y).transpose(0, 1)


def test_the_batch_follows_permutes_and_transposes():
    """The batch dim after ``permute(*dims)``, ``unbind`` of another dim and
    ``transpose(i, j)``: permute's separate arguments and every transpose were read as
    no move, so the batch stayed on dim 0 (a pipeline plan raised: ``permute: batch
    extent 3 is not divisible by 2 microbatches``), and a part along another dim lost it
    unless the batch led."""
    g = trace(TimmAttention(), (torch.randn(4, 6, 16),))
    sample = {n.name: [d.dim for d in n.dims.output if d.kind == "sample"] for n in g.nodes}
    assert sample["permute"] == [1] and sample["unbind"] == [0] and sample["scaled_dot_product_attention"] == [0]
    assert sample["transpose"] == [0] and sample["proj"] == [0] and sample["transpose_1"] == [1]
    from flexsearch.graph.registry import Call, rule_for

    for key, args in (("transpose", (None, 0, 1)), ("permute", (None, 1, 0)), ("permute", (None, [1, 0]))):
        assert rule_for(key, Call(((8, 4),), (0,), (4, 8), args)).out_batch == 1, (key, args)  # a 2-D one too
    plan = flexsearch.plan(TimmAttention(), (torch.randn(4, 6, 16),), devices=2, cluster="cpu",
                           kinds=["pipeline"], max_iters=0)
    assert plan.kind == "pipeline"


def test_repeated_blocks_found():
    g = trace(TinyGPT(layers=4), gpt_inputs())
    assert len(g.blocks) == 1
    group = g.blocks[0]
    assert group.module_type == "Block"
    assert group.modules == ("h.0", "h.1", "h.2", "h.3")
    sizes = {len(i) for i in group.instances}
    assert len(sizes) == 1 and sizes.pop() > 5
    for i, inst in enumerate(group.instances):
        for k, name in enumerate(inst):
            ref = g.node(name).block
            assert (ref.group, ref.instance, ref.position) == (0, i, k)
    # the k-th op of every copy is the same op
    for k in range(len(group.instances[0])):
        assert len({g.node(inst[k]).target for inst in group.instances}) == 1


def test_different_blocks_not_grouped():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
            self.b = nn.Sequential(nn.Linear(8, 8), nn.Tanh())

        def forward(self, x):
            return self.b(self.a(x))

    assert trace(Net(), (torch.randn(2, 8),)).blocks == ()


def test_graph_is_immutable_and_round_trips_json():
    g = trace(TinyGPT(layers=2), gpt_inputs())
    with pytest.raises(ValidationError):
        g.nodes[0].flops = 3
    again = OpGraph.from_json(g.to_json())
    assert again == g
    assert again.fingerprint == g.fingerprint
    assert trace(TinyGPT(layers=2), gpt_inputs()).fingerprint == g.fingerprint
    assert trace(TinyGPT(layers=3), gpt_inputs()).fingerprint != g.fingerprint


def test_meta_model_uses_no_memory():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(50_000, 50_000), nn.ReLU(), nn.Linear(50_000, 50_000))
        x = torch.empty(64, 50_000)
    g = trace(model, (x,))
    assert g.num_params == 2 * (50_000 * 50_000 + 50_000)
    assert g.flops == 2 * 2 * 64 * 50_000 * 50_000


def test_cnn_inplace_and_residual():
    class Res(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 3, 3, padding=1)
            self.bn = nn.BatchNorm2d(3)
            self.relu = nn.ReLU(inplace=True)
            self.pool = nn.AdaptiveAvgPool2d(1)
            self.fc = nn.Linear(3, 5)

        def forward(self, x):
            out = self.bn(self.conv(x))
            out += x
            out = self.relu(out)
            return self.fc(torch.flatten(self.pool(out), 1))

    model = Res()
    x = torch.randn(4, 3, 8, 8)
    g = trace(model, (x,))
    conv = g.node("conv")
    assert conv.kind == "conv"
    assert [(d.dim, d.kind) for d in conv.dims.output] == [(0, "sample"), (1, "parameter"), (2, "attribute"), (3, "attribute")]
    assert g.node("bn").num_params == 6
    assert g.num_params == sum(p.numel() for p in model.parameters())
    assert g.flops == reference_flops(model, (x,))
    fc = g.node("fc")
    assert fc.dims.output[0].kind == "sample"
    assert model.bn.running_mean.abs().sum() == 0  # the real buffers were not touched


def test_lstm_batch_dim_follows_batch_first():
    class Seq(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(20, 8)
            self.rnn = nn.LSTM(8, 16, num_layers=2)  # time-major

        def forward(self, tokens):
            out, _ = self.rnn(self.emb(tokens).transpose(0, 1))
            return out[-1]

    g = trace(Seq(), (torch.randint(0, 20, (6, 10)),))
    rnn = g.node("rnn")
    assert rnn.kind == "rnn" and rnn.flops > 0
    assert [(d.dim, d.kind) for d in rnn.dims.output] == [(1, "sample")]
    last = g.nodes[-2]  # out[-1]: [batch, hidden]
    assert last.dims.output[0].kind == "sample"


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU, nn.RNN])
@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("batch", [12, 100])  # run at the batch; beyond 64, extrapolated from 32 and 64
def test_recurrent_layer_keeps_what_its_fused_kernel_saves(cls, batch_first, batch):
    """A recurrent layer's saved bytes are what the kernel that trains saves: the same
    as a real forward at the traced batch saves (oneDNN's workspace is padded at small
    batches, so two small batches would not extrapolate)."""
    layer = cls(24, 32, num_layers=2, batch_first=batch_first)

    class Seq(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = layer

        def forward(self, x):
            return self.rnn(x)[0]

    x = torch.randn((batch, 7, 24) if batch_first else (7, batch, 24))
    node = trace(Seq(), (x,)).node("rnn")
    packed = {}

    def pack(t):
        packed.setdefault(storage(t), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x.requires_grad_())
    real = sum(v for k, v in packed.items() if k not in {storage(p) for p in layer.parameters()} | {storage(x)})
    assert node.saved_bytes == pytest.approx(real, rel=0.02)


class Rotary(nn.Module):
    """A first Linear on the model's float input, then queries rotated by a table made
    from a buffer (RoPE: ``q * cos + rotate_half(q) * sin``), as Llama does."""

    def __init__(self, d: int = 16, seq: int = 8):
        super().__init__()
        self.inp, self.q, self.out = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d), persistent=False)
        self.seq = seq

    def forward(self, x):
        freqs = torch.outer(torch.arange(self.seq, dtype=torch.float32), self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        q = self.q(self.inp(x))
        half = q.shape[-1] // 2
        rotated = torch.cat((-q[..., half:], q[..., :half]), dim=-1)
        return self.out(q * cos + rotated * sin)


def test_only_inputs_computed_from_parameters_get_gradients():
    """An op computes and saves for the inputs that need a gradient in the model, as
    autograd does: the first Linear no gradient of the model's input, RoPE's ``q * cos``
    none of the table ``cos`` (so it keeps ``cos``, not ``q``), and the table's own ops
    nothing. Checked against the eager step: its backward's FLOPs
    (``FlopCounterMode``) and the tensors autograd saves (``saved_tensors_hooks``)."""
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    model, x = Rotary(), torch.randn(4, 8, 16)
    g = trace(model, (x,))
    with FlopCounterMode(display=False) as counter:
        y = model(x)
    forward = counter.get_total_flops()
    with FlopCounterMode(display=False) as counter:
        y.sum().backward()
    assert g.flops == forward
    assert g.backward_flops == counter.get_total_flops()  # 2x forward, less the first layer's input gradient
    assert g.node("inp").backward_flops == g.node("inp").flops
    # the first Linear and the last have one shape but not one backward: the profiler
    # measures each (its entries are keyed by signature) with its own operands' gradients
    assert g.node("inp").signature != g.node("out").signature
    assert g.node("q").signature == g.node("out").signature
    _, calls = trace_calls(model, (x,))
    assert calls["inp"].args[0].grad is False and calls["out"].args[0].grad is True

    packed = {}

    def pack(t):
        packed.setdefault(storage(t), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        pack(model(x))  # the output too: held for the loss
    real = sum(v for k, v in packed.items() if k not in {storage(p) for p in model.parameters()} | {storage(x)})
    assert sum(n.saved_bytes or 0 for n in g.nodes) == real
    assert not g.node("q").saved_bytes  # saved by no op: q * cos keeps cos, the Linear its input
    assert g.node("mul").saved_bytes == 8 * 16 * 4  # the table (made from buffers, folded) that q * cos keeps


def test_opaque_op_is_costed_not_split():
    class Odd(nn.Module):
        def forward(self, x):
            return torch.cumsum(x, dim=1) * 2

    g = trace(Odd(), (torch.randn(4, 8),))
    cum = g.node("cumsum")
    assert cum.opaque and cum.kind == "opaque" and cum.dims.output == ()
    assert cum.bytes_read == 4 * 8 * 4 and cum.bytes_written == 4 * 8 * 4
    assert g.opaque_nodes == (cum,)


class _Layouts(nn.Module):
    """Views, a real copy and an in-place op on activations (Hugging Face GPT-2's
    ``Conv1D``: ``addmm`` with a transposed weight)."""

    def __init__(self) -> None:
        super().__init__()
        self.w, self.b = nn.Parameter(torch.randn(8, 12)), nn.Parameter(torch.zeros(12))

    def forward(self, x):
        y = torch.addmm(self.b, x.view(-1, 8), self.w).view(4, 3, 12)
        z = y.transpose(1, 2)            # a view
        c = z.contiguous()               # a copy
        c.add_(1.0)                      # reads and writes c
        return c.reshape(4, 36)          # contiguous: a view


@pytest.mark.parametrize("via", ["fx", "export"])
def test_views_move_no_bytes_copies_and_in_place_ops_do(via, monkeypatch):
    """An op's outputs that alias the inputs it ran on cost no memory traffic (the
    tracer runs each op on fresh leaf copies of its inputs: the alias is with those);
    the same on the ATen graph torch.export makes (fx made to fail, as it does for code
    it cannot follow)."""
    from flexsearch.graph import lift

    if via == "export":
        monkeypatch.setattr(lift, "fx_graph_module", lambda m: (_ for _ in ()).throw(RuntimeError("no fx")))
    g = trace(_Layouts(), (torch.randn(4, 3, 8),))
    assert g.via == via
    size = 4 * 3 * 12 * 4
    views = [n for n in g.nodes if n.kind == "view" and "contiguous" not in n.target and "clone" not in n.target]
    assert views and all(n.bytes_read == n.bytes_written == 0 for n in views), [(n.name, n.bytes_written)
                                                                              for n in views]
    copy = next(n for n in g.nodes if "contiguous" in n.target or "clone" in n.target)
    assert copy.bytes_written == size
    add = next(n for n in g.nodes if "add" in n.target and "addmm" not in n.target)
    assert add.bytes_written == size
    mm = next(n for n in g.nodes if "addmm" in n.target)
    assert mm.kind == "linear" and not mm.opaque and {d.kind for d in mm.dims.output} >= {"parameter"}
    # (4, 3, 8) -> (12, 8) merges the batch with the next dim: its rows are still split
    # by sample (data parallelism divides the op), and so is (12, 12) -> (4, 3, 12)
    assert mm.dims.output[0].kind == "sample"
    assert all(n.dims.output[0].kind == "sample" for n in g.nodes if n.kind not in ("input", "output"))


def test_shape_control_flow_falls_back_to_export():
    class ShapeBranch(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            if x.shape[0] > 2:  # fx cannot follow this; export specialises it
                return self.a(x)
            return self.b(x)

    model = ShapeBranch()
    g = trace(model, (torch.randn(4, 8),))
    assert g.via == "export"
    assert [n.kind for n in g.nodes] == ["input", "linear", "output"]
    lin = g.nodes[1]
    assert lin.params == ("a.weight", "a.bias") and lin.num_params == 72
    assert lin.dims.output[-1].kind == "parameter"
    # parameters of the branch not taken are reported, not silently counted
    assert g.unused_params == 72


def test_value_control_flow_is_one_line_trace_error():
    class ValueBranch(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 8)

        def forward(self, x):
            y = self.a(x)
            if y.sum() > 0:
                return y * 2
            return y

    with pytest.raises(TraceError) as info:
        trace(ValueBranch(), (torch.randn(4, 8),))
    msg = str(info.value)
    assert "\n" not in msg
    assert "test_tracer.py" in msg and "if y.sum() > 0:" in msg
    assert "torch.where" in msg  # what the user can do


def test_hf_style_kwargs_and_dict_output():
    class HF(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(50, 16)
            self.fc = nn.Linear(16, 50)

        def forward(self, input_ids, attention_mask=None):
            h = self.emb(input_ids)
            if attention_mask is not None:
                h = h * attention_mask.unsqueeze(-1)
            return {"logits": self.fc(h)}

    ids = torch.randint(0, 50, (2, 7))
    g = trace(HF(), (ids, {"attention_mask": torch.ones(2, 7)}))
    assert g.node("fc").outputs[0].shape == (2, 7, 50)
    assert g.nodes[-1].kind == "output"
    mul = next(n for n in g.nodes if n.kind == "elementwise")
    assert mul.dims.output[0].kind == "sample"


def test_not_a_module():
    with pytest.raises(TraceError, match="nn.Module"):
        trace(lambda x: x, (torch.zeros(1),))


def test_inputs_forward_does_not_take_are_a_trace_error():
    """An example input the model's forward does not take (it was dropped from the graph,
    and the plan made without it), or one it needs that is missing: one line naming the
    signature, from trace and from plan; a trailing dict is keyword arguments."""
    x = torch.zeros(16, 8)
    with pytest.raises(TraceError, match=r"do not fit Linear.forward\(input: torch.Tensor\).*too many positional"):
        trace(nn.Linear(8, 8), (x, 3))
    with pytest.raises(TraceError, match="unexpected keyword argument 'mask'"):
        flexsearch.plan(nn.Linear(8, 8), (x, {"mask": x}), devices=2, max_iters=0)
    with pytest.raises(TraceError, match="missing a required argument: 'b'"):
        trace(Two(), (x,))
    assert trace(Two(), (x, {"b": x})).nodes  # keyword arguments bind


class Two(nn.Module):
    def forward(self, a, b):
        return a * b


def test_exported_graphs_run_on_cpu_whatever_device_the_model_was_on():
    """An exported graph bakes the model's device into the tensors its ops create; on a
    GPU (``flexsearch profile`` of a Hugging Face GPT-2 on an H100: ``found two different
    devices cpu, cuda:0`` at its position embedding) that was ``cuda:0`` while the tracer
    measures on fake CPU tensors. Every device, as a ``torch.device`` or a string, becomes
    ``cpu``; other strings stay."""
    from flexsearch.graph.lift import _devices_to_cpu

    class Positions(nn.Module):
        def __init__(self):
            super().__init__()
            self.wpe = nn.Embedding(16, 4)

        def forward(self, x):
            return self.wpe(torch.arange(x.shape[1], device=x.device)) + x

    gm = torch.export.export(Positions(), (torch.randn(2, 8, 4),), strict=False).module()
    made = [n for n in gm.graph.nodes if n.op == "call_function" and "device" in n.kwargs]
    assert made
    for n, dev in zip(made, [torch.device("cuda", 0), "cuda:0", "meta"] * len(made), strict=False):
        n.kwargs = {**n.kwargs, "device": dev}  # as exported on a GPU (no GPU here)
    gm.recompile()
    _devices_to_cpu(gm)
    assert all(n.kwargs["device"] == torch.device("cpu") for n in made)
    assert gm(torch.randn(2, 8, 4)).shape == (2, 8, 4)
    from flexsearch.graph.lift import DEVICE_NAME  # strings like "mean" are not devices

    assert DEVICE_NAME.fullmatch("cuda:1") and DEVICE_NAME.fullmatch("meta") and not DEVICE_NAME.fullmatch("mean")


class _Repeats(nn.Module):
    """Calls a replay must tell apart or map right, each twice or more: views of an
    integer input and of a float one, a fresh copy of an input's slice, an op on one
    tensor twice, constants that are slices and sizes, in-place ops, dropout that
    returns its input, a split into views, an op returning several fresh tensors, a
    frozen layer beside a trained one of the same shape."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.drop = nn.Dropout(0.0)
        self.lstm = nn.LSTM(8, 8, batch_first=True)

    def forward(self, x, ids):
        pos = ids[:, :4].reshape(-1)
        x = x + pos.float().mean()
        for layer in (self.a, self.b, self.frozen, self.a):
            y = layer(x)
            y = self.drop(y) * y
            y.mul_(0.5)
            q, k = y.split(4, dim=-1)
            x = x + torch.cat([k, q], dim=-1).relu()
            x = x + x.new_zeros(x.shape) + x[:, 1:3].sum() + x.transpose(1, 2).contiguous().transpose(1, 2)
            x = x + ids.flatten().float().mean()
        out, (h, c) = self.lstm(x)
        out2, _ = self.lstm(out)
        return out2 + h.transpose(0, 1) + c.transpose(0, 1)


_NOTHING_REPEATED = ("rnntc_tiny", "rnnlm_tiny")
"""Cases with no call identical to an earlier one (one recurrent layer between others)."""


class _LookAlikes(nn.Module):
    """Calls that look alike to a careless replay key and are not (each pair differs in
    one thing the graph shows downstream): ``detach`` and a straight-through estimator,
    ``view(dtype)``, ``* 1`` and ``* 1.0``, a forward hook and a pre-hook on one of two
    twin layers, encoder layers whose activation modules differ in class only, a
    parameter's view and an activation of the same layout, ``requires_grad_`` and an
    in-place op that makes a tensor need a gradient, ``unsqueeze_`` of integer tensors
    (not copied by the tracer), a constant tensor expanded."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.hooked, self.pre_hooked = nn.Linear(8, 8), nn.Linear(8, 8)
        self.hooked.register_forward_hook(lambda m, i, o: o.double().float() * 2)
        self.pre_hooked.register_forward_pre_hook(lambda m, i: (i[0] + m.adapter(i[0]),))
        self.pre_hooked.adapter = nn.Linear(8, 8)
        self.tanh = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True, activation=nn.Tanh())
        self.soft = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True, activation=nn.Softsign())
        self.w = nn.Parameter(torch.randn(8, 8))
        self.register_buffer("scale", torch.randn(8, 1), persistent=False)

    def forward(self, x, ids):
        t1, t2 = self.a(x).detach(), self.b(x).detach()
        y = self.c(t1) + self.c(t2)
        h = self.a(y)
        y = y + h + (self.b(h) - h).detach()
        p, q = self.a(y).view(torch.int32), self.b(y).view(torch.int32)
        y = y + (p + q).float().sum(-1, keepdim=True) + ids.view(torch.float64).float().mean()
        m = ids * 1
        y = y + (ids * 1.0).unsqueeze(-1) + m.unsqueeze(-1)
        y = self.hooked(y) + self.c(y) + self.pre_hooked(y) + self.a(y)
        y = self.tanh(y) + self.soft(y)
        y = y @ self.w.t() + y @ self.a(y.reshape(-1, 8)[:8]).t()
        g = (y * 2).detach().requires_grad_()
        k = (y * 3).detach()
        k.add_(self.c(y))
        y = self.c(g) + self.c(k)
        i1, i2 = ids * 2, ids * 3
        i1.unsqueeze_(0)
        i2.unsqueeze_(0)
        y = y + i1.float().sum() + i2.float().sum()
        return y + self.scale.expand(8, 8)[0] + y.sum((0, 1)).expand(8, 8)[0]


def _replay_cases():
    import sys

    from conftest import ROOT
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from zoo import ZOO
    cases = [e.name for e in ZOO if e.size == "tiny"] + ["hf:gpt2", "hf:llama", "hf:mixtral", "hf:t5", "hf:vit",
                                                          "repeats", "look-alikes"]
    slow = ("hf:t5", "hf:mixtral", "nmt_tiny", "inception_tiny")  # 9-14 s each; the others cover their calls' kinds
    return [pytest.param(c, marks=pytest.mark.slow) if c in slow else c for c in cases]


@pytest.mark.parametrize("case", _replay_cases())
def test_replayed_calls_trace_the_graph_running_every_call_gives(case, monkeypatch):
    """A call identical to an earlier one up to names is not run again but replayed
    (:mod:`flexsearch.graph.measure`): the graph, the calls kept for the profiler and
    the graph under mixed precision (both of its passes) are those the tracer gives
    running every call; and calls were replayed."""
    import flexsearch.graph.measure as measure
    import flexsearch.graph.tracer as tracer
    from flexsearch import load_model

    if case == "repeats":
        model, inputs = _Repeats(), (torch.randn(2, 6, 8), torch.randint(0, 5, (2, 6)))
    elif case == "look-alikes":
        model, inputs = _LookAlikes(), (torch.randn(2, 6, 8), torch.randint(0, 5, (2, 6)))
    elif case.startswith("hf:"):
        import importlib.util

        from conftest import ROOT
        pytest.importorskip("transformers")
        spec = importlib.util.spec_from_file_location("tests_hf_models", ROOT / "tests" / "hf_models.py")
        hf_models = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(hf_models)
        model, inputs = hf_models.build(case[3:])
    else:
        import sys

        from conftest import ROOT
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from zoo import get
        model, inputs = load_model(get(case).abs_spec)
    made: list[measure.Measure] = []

    class Counted(measure.Measure):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(tracer, "Measure", Counted)
    for precision in ("fp32", "bf16-mixed"):
        traced = {}
        for replay in (False, True):
            monkeypatch.setattr(measure, "REPLAY", replay)
            made.clear()
            graph, calls = trace_calls(model, inputs, precision=precision)
            traced[replay] = graph.model_dump(), calls, sum(m.replayed for m in made)
        assert traced[True][0] == traced[False][0], (case, precision)
        assert traced[True][1] == traced[False][1], (case, precision)
        assert traced[False][2] == 0, (case, precision)
        assert traced[True][2] > 0 or case in _NOTHING_REPEATED, (case, precision)


def test_an_op_that_cannot_run_on_fake_tensors_is_one_line_naming_the_fix(caplog):
    """Inputs of the wrong shape: the op's own check, one line (fx's node dump and the
    fake-tensor kernel's logged traceback left out) asking to check the inputs; a shape
    that depends on the data (boolean indexing): the advice to compute densely and mask."""
    import logging

    class Masked(nn.Module):
        def forward(self, x):
            return x[x > 0] * 2

    with caplog.at_level(logging.ERROR), pytest.raises(TraceError) as wrong:
        trace(nn.Linear(4, 4), (torch.randn(8, 5),))
    assert "\n" not in str(wrong.value) and "example inputs have the shapes" in str(wrong.value)
    assert not [r for r in caplog.records if r.name.startswith("torch._subclasses")]
    with pytest.raises(TraceError, match="keep every shape independent of the values: compute densely and mask"):
        trace(Masked(), (torch.randn(8, 5),))


def test_a_constant_made_in_forward_is_no_model_input():
    """``torch.export`` lifts a tensor made inside ``forward`` (Falcon's and Whisper's
    attention make some) to a graph input: it is a constant of the graph, not an input of
    the model (recorded as one, every plan of such a model asked for inputs the model
    does not take, and no plan could be emitted)."""

    class Lifted(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(2, 8)

        def forward(self, x):
            if x.shape[1] > 4:  # symbolic tracing cannot follow this: torch.export
                x = x * 2
            return self.l(x[:, torch.tensor([0, 1])])

    g = trace(Lifted(), (torch.randn(8, 16),))
    assert g.via == "export"
    assert [tuple(n.outputs[0].shape) for n in g.nodes if n.kind == "input"] == [(8, 16)]


def test_frozen_layers_count_no_weight_gradient_and_the_notes_say_so():
    """A frozen layer (``requires_grad=False``) and its trainable twin of the same shapes
    are measured apart: only the trainable one's backward computes a weight gradient (they
    shared the first one's count); each node records its frozen bytes, and the graph's
    notes say how many parameters are frozen."""
    layers = nn.Sequential(*[nn.Linear(32, 32) for _ in range(3)])
    for i, layer in enumerate(layers):
        layer.requires_grad_(i == 2)
    g = trace(layers, (torch.randn(4, 32),))
    assert [n.backward_flops for n in g.nodes if n.flops] == [0, 0, 2 * 4 * 32 * 32]
    assert any("2,112 of 3,168 parameters are frozen" in n for n in g.notes)
    assert [(n.param_bytes, n.trained_param_bytes) for n in g.nodes if n.param_bytes] == \
        [(1056 * 4, 0), (1056 * 4, 0), (1056 * 4, 1056 * 4)]


def test_a_grouped_convolution_is_not_split_by_its_filters():
    """A depthwise convolution (ConvNeXt's): a share of its filters reads the matching
    share of the input channels, which no configuration runs, so its channels are no
    parameter dim (a SOAP plan split it by filters and the emitted conv raised
    ``Given groups=32, expected weight to be at least 32 at dimension 0``)."""
    from flexsearch.strategy.config import legal, parse_config

    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 7, padding=3, groups=8))
    g = trace(model, (torch.randn(4, 3, 16, 16),))
    dense, depthwise = (n for n in g.nodes if n.kind == "conv")
    assert [d.kind for d in dense.dims.output if d.dim == 1] == ["parameter"] and dense.dims.reduced
    assert all(d.dim != 1 for d in depthwise.dims.output) and not depthwise.dims.reduced
    assert legal(dense, parse_config("s1.p2:1"), 2) and not legal(depthwise, parse_config("s1.p2:1"), 2)
    assert legal(depthwise, parse_config("s2"), 2)


class RoundST(torch.autograd.Function):
    """Rounding with a straight-through gradient (quantisation-aware training)."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, g):
        return g


class Quantised(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(16, 32), nn.Linear(32, 8)

    def forward(self, x):
        return self.l2(RoundST.apply(self.l1(x)))


def quantised():
    torch.manual_seed(0)
    return Quantised(), (torch.randn(8, 16),)


def verify_job(rank: int, world: int, cases: list) -> list[float]:
    """Each (model builder's name, plan) verified against an MSE loss on this rank."""
    from flexsearch.emit.verify import verify

    out = []
    for name, plan in cases:
        model, x = {"quantised": quantised, "centred": centred}[name]()
        out.append(verify(model, plan, x, torch.zeros(8, 8), lambda o, y: F.mse_loss(o, y))["loss"])
    return out


class Centred(nn.Module):
    """An exponential moving average of a feature, updated in place under ``no_grad``."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(16, 32), nn.Linear(32, 8)
        self.register_buffer("mu", torch.zeros(32))

    def forward(self, x):
        h = torch.tanh(self.l1(x))
        with torch.no_grad():
            self.mu.mul_(0.9).add_(0.1 * h.mean(0))
        return self.l2(h - self.mu)


def centred():
    torch.manual_seed(0)
    return Centred(), (torch.randn(8, 16),)


def test_what_fx_loses_is_kept_and_the_plans_verify():
    """A custom ``autograd.Function`` is one node (split by the samples only), not the
    ops of its ``forward``: fx traced through it and dropped its ``backward``, so SOAP
    and pipeline plans trained ``l1`` with a zero gradient (rounding's), silently. And
    a buffer updated in place under ``no_grad``: symbolic tracing ran
    ``self.mu.mul_(0.9)`` once, for real, on the model's buffer (it is not in the graph),
    and recorded the ``add_`` without its ``no_grad``, so a SOAP plan's buffer joined the
    autograd graph (``Trying to backward through the graph a second time``); such a model
    is traced by ``torch.export``, its buffer untouched. The three plans verify on 2
    ranks (one launch)."""
    from flexsearch.emit.launch import run_ranks

    model, x = quantised()
    g = trace(model, x)
    (node,) = [n for n in g.nodes if n.name == "round_st_apply"]
    assert node.kind == "elementwise" and [(d.dim, d.kind) for d in node.dims.output] == [(0, "sample")]
    assert not any(n.target.startswith(("torch.round", "Tensor.round")) for n in g.nodes)
    cases = [("quantised", flexsearch.plan(model, x, devices=2, cluster="cpu", kinds=[kind], max_iters=20,
                                           precision="fp32")) for kind in ("soap", "pipeline")]
    ema, y = centred()
    assert trace(ema, y).via == "export" and torch.equal(ema.mu, torch.zeros(32))
    cases.append(("centred", flexsearch.plan(ema, y, devices=2, cluster="cpu", kinds=["soap"], max_iters=20,
                                             precision="fp32")))
    run_ranks(verify_job, 2, cases, timeout_s=300)  # verify raises on a mismatch


def test_packed_sequences_get_their_own_advice():
    """An LSTM over ``pack_padded_sequence``: the error names the function tracing does
    not enter and says to pad and mask (it said to select branches with torch.where,
    after a reason cut mid-path)."""
    from flexsearch.errors import TraceError
    from flexsearch.graph.lift import ADVICE, PACKED_ADVICE, SKIPPED_ADVICE, _break_reason, advice

    class Packed(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.LSTM(4, 8, batch_first=True)

        def forward(self, x, lengths):
            p = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
            out, _ = self.rnn(p)
            return nn.utils.rnn.pad_packed_sequence(out, batch_first=True)[0].sum(1)

    with pytest.raises(TraceError) as e:
        trace(Packed(), (torch.randn(4, 5, 4), torch.tensor([5, 3, 2, 1])))
    msg = str(e.value)
    assert "pack_padded_sequence" in msg and PACKED_ADVICE in msg and ADVICE not in msg, msg
    long = "word " * 60
    assert _break_reason(long).endswith("word ...") and len(_break_reason(long)) <= 164
    skipped = "Attempted to call function marked as skipped ... the function `{}` in file `/x`"
    packed, other = (f"m.py:3 `...`: {_break_reason(skipped.format(f))}" for f in ("pack_padded_sequence", "f"))
    assert advice([packed]) == PACKED_ADVICE and advice([other]) == SKIPPED_ADVICE
    assert advice([other, "m.py:4 `if x.sum() > 0:`: a branch on a tensor's value"]) == f"{SKIPPED_ADVICE}; {ADVICE}"


class LoopMoE(nn.Module):
    """A mixture of experts as it is often hand-written: each expert gathers its tokens
    with ``torch.where(idx == e)`` (a shape that depends on the routing's values)."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(8, 2)
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x):
        idx = self.gate(x).argmax(-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            (tok,) = torch.where(idx == e)
            out = out.index_add(0, tok, expert(x[tok]))
        return out


def test_a_value_dependent_shape_gets_dense_advice():
    """An op whose output's shape depends on the values (an MoE's per-expert gather):
    the error says to compute densely or with a fixed capacity, not to select branches
    with torch.where (which is what broke it)."""
    from flexsearch.graph.lift import ADVICE, SHAPE_ADVICE, advice

    with pytest.raises(TraceError) as e:
        trace(LoopMoE(), (torch.randn(16, 8),))
    msg = str(e.value)
    assert "\n" not in msg and SHAPE_ADVICE in msg and ADVICE not in msg, msg
    shape = "m.py:5 `(tok,) = torch.where(idx == e)`: Dynamic shape operator Explanation: ..."
    branch = "m.py:4 `if x.sum() > 0:`: a branch on a tensor's value"
    assert advice([shape]) == SHAPE_ADVICE and advice([shape, branch]) == f"{SHAPE_ADVICE}; {ADVICE}"


def test_a_trace_pauses_the_cycle_collector_and_restores_it(monkeypatch):
    """Tracing runs with Python's cyclic collector paused (:mod:`flexsearch.collector`:
    Megatron's GPT 1T traces 15-33% faster), and leaves it as it found it, on or off."""
    import gc

    from flexsearch.graph.measure import Measure

    seen = []
    run_all = Measure.run_all

    def spy(self, *a, **k):
        seen.append(gc.isenabled())
        return run_all(self, *a, **k)

    monkeypatch.setattr(Measure, "run_all", spy)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    assert gc.isenabled()
    trace(model, torch.randn(3, 4), precision="bf16-mixed", workers=1)  # both passes here
    assert seen == [False, False]  # both passes (the second with autocast's parameters)
    assert gc.isenabled()
    gc.disable()
    try:
        trace(model, torch.randn(3, 4))
        assert not gc.isenabled()
    finally:
        gc.enable()
