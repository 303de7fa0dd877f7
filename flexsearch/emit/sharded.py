"""SOAP plans on DTensor: every op runs with the placements its configuration names.

The model's FX graph (the one the tracer lifted; node names are the plan's op names)
is run by an interpreter (:class:`ShardedModule`): the ``torch.fx`` graph with the
model's layers as nodes, or, for a model only ``torch.export`` traces, the exported
ATen graph, whose weights come in as arguments (:func:`arg_placement` splits them as
:func:`param_placement` splits a layer's). For an op with configuration
``Config(s, kind, t, dim, first)`` (see :mod:`flexsearch.strategy.config`):

- **mesh**: the ``s x t`` :class:`DeviceMesh` of devices ``first .. first+s*t-1``
  (mesh dims ``("s", "t")``; ranks outside it hold empty shards and skip the op);
- **inputs** and **parameters**: the placements of :mod:`flexsearch.emit.placements`
  (``Shard`` of what the op's split reads, else ``Replicate``; the styles of
  ``parallelize_module``'s ``ColwiseParallel``/``RowwiseParallel``, per op).

Then the op itself runs on DTensors: DTensor's sharding propagation computes its
output placement (e.g. ``Partial`` after a row-wise Linear) and redistributes when an
op's strategy needs it, so every op computes exactly what the original did. Between
ops on the *same* mesh, ``DTensor.redistribute`` moves data (all-gather, all-to-all,
all-reduce); between *different* meshes (the operation dimension of SOAP: ops on
different device blocks), :func:`~flexsearch.emit.transport.to_layout` gathers the tensor on its block and broadcasts
it to the ranks of the next block (and the gradient back in the backward pass).

Each parameter lives once, on the mesh and placement of the first op that uses it; a
tied parameter used by another op on another layout is moved there (autograd-aware).
After the backward pass a hook redistributes each gradient to its parameter's
placements (the all-reduce of a data-parallel gradient, on the ranks that hold it).

Calling convention: every rank calls the module with the same *global* batch and gets
the whole output back (a plain tensor, the same on every rank), so the loss is computed
as in single-process code; gradients land in the DTensor parameters, and any torch
optimizer steps them.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Mapping
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_tensor,
)
from torch.distributed.tensor.experimental import implicit_replication
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from flexsearch.emit.dense import dense_grad, dense_input
from flexsearch.emit.inputs import split, step_loss
from flexsearch.emit.losses import loss_by_samples, loss_call
from flexsearch.emit.placements import REPLICATE, arg_placement, input_placements, param_placement
from flexsearch.emit.precision import autocast, backward, cast_inputs, cast_model
from flexsearch.emit.recompute import run_checkpointed, run_edges, unit_runs
from flexsearch.emit.runtime import Runtime
from flexsearch.emit.transport import (
    Anchor,
    Whole,
    build_layouts,
    dense_stride,
    to_layout,
    whole_grad,
)
from flexsearch.emit.writes import AS_PLANNED, write_in_place
from flexsearch.errors import EmitError
from flexsearch.graph.lift import flat_inputs
from flexsearch.graph.microbatch import batch_dim
from flexsearch.graph.opgraph import OpGraph, OpNode
from flexsearch.strategy.config import Config, is_source
from flexsearch.strategy.recompute import partial_unit_op


def last_uses(graph: fx.Graph) -> dict[fx.Node, list[fx.Node]]:
    """Per node, the values whose last reader it is (the output's are never freed): the
    interpreter drops them from its environment once that node has run, so a value
    autograd does not save (a row-parallel Linear's partial sums once all-reduced, a
    gathered copy once read) is freed at once, not at the end of the forward, as the
    memory model assumes. On Megatron's layout of the tiny GPT (fp32, 2 ranks) that
    took the allocator's peak from 5.40-5.43 MB to 4.77-4.90 MB
    (``tests/test_memory_tracker.py``, tensor-parallel check)."""
    out: dict[fx.Node, list[fx.Node]] = {}
    seen: set[fx.Node] = set()
    for n in reversed(graph.nodes):
        for a in n.all_input_nodes:
            if a not in seen:
                seen.add(a)
                if n.op != "output":
                    out.setdefault(n, []).append(a)
    return out



class ShardedModule(nn.Module):
    """A model running a SOAP plan with DTensor (see the module docstring).

    ``module`` is a copy of the user's model whose parameters and buffers are DTensors
    (state-dict keys are the original names); the interpreter runs its FX graph."""

    def __init__(self, model: nn.Module, gm: fx.GraphModule, graph: OpGraph,
                 configs: Mapping[str, Config], rt: Runtime, distributed: dict[int, torch.Tensor] | None = None,
                 recompute: str = "none"):
        """``distributed``: id of an original tensor -> its DTensor, shared by the stage
        modules of one rank, so a weight two of them hold (tied) stays one parameter;
        ``recompute``: activation checkpointing of the graph's units, each unit's run of
        ops interpreted under ``torch.utils.checkpoint`` (``EmitError`` where a unit's op
        runs on part of the devices: the ranks would rebuild different ops)
        (:func:`flexsearch.emit.recompute.run_checkpointed`), its redistributions
        included."""
        super().__init__()
        self.module = model
        self._gm = [gm]  # not a submodule: its layers are ``module``'s
        self._graph = graph
        self._configs = dict(configs)
        self._rt = rt
        self._shapes: dict[tuple, Any] = {}
        """Output shapes of locally run ops per (node, input shapes): found once on meta
        tensors (an LSTM there runs decomposed, one op per gate and time step: tens of
        milliseconds per call)."""
        self._last_uses = last_uses(gm.graph)
        self._recompute = recompute
        if recompute != "none" and (op := partial_unit_op(graph, self._configs, len(rt.ranks))) is not None:
            raise EmitError(f"the plan recomputes op {op}, which runs on part of the devices: a DTensor plan "
                            "recomputes only where every op of a unit runs on every device; plan again")
        self._runs = {} if recompute == "none" else {run[0]: (run, *run_edges(run)) for run in unit_runs(gm, graph)}
        build_layouts(rt, self._configs.values())
        self._world = rt.block_mesh(0, len(rt.ranks), 1)
        self._distribute({} if distributed is None else distributed)

    # -- placing parameters: each on the layout of its first user
    def _mesh(self, c: Config):
        return self._rt.block_mesh(c.first, c.s, c.t)

    def _distribute(self, done: dict[int, torch.Tensor]) -> None:
        gm = self._gm[0]
        by = self._graph.by_name
        homes: dict[int, tuple[Any, tuple]] = {}
        for n in gm.graph.nodes:
            node = by.get(n.name)
            c = self._configs.get(n.name, Config())
            if n.op == "call_module" and node is not None:
                mod = gm.get_submodule(n.target)
                for pname, p in list(mod.named_parameters(recurse=True)) + list(mod.named_buffers(recurse=True)):
                    homes.setdefault(id(p), (self._mesh(c), param_placement(mod, pname, c)))
            elif n.op == "get_attr":
                user = next((u for u in n.users if u.name in by and not is_source(by[u.name])), None)
                uc = self._configs.get(user.name, Config()) if user is not None else Config()
                pl = arg_placement(user, user.args.index(n), uc) if user is not None and n in user.args \
                    else REPLICATE
                homes.setdefault(id(self._fetch(n.target)), (self._mesh(uc), pl))
        # an exported graph module holds the model's tensors in a module tree of its own
        for mod in {id(m): m for m in (*self.module.modules(), *gm.modules())}.values():
            for table in (mod._parameters, mod._buffers):
                for key, p in list(table.items()):
                    if p is None:
                        continue
                    if id(p) not in done:
                        mesh, pl = homes.get(id(p), (self._world, REPLICATE))
                        d = distribute_tensor(p.detach(), mesh, pl, src_data_rank=0)  # the mesh's first rank's values
                        if isinstance(p, nn.Parameter):
                            d = nn.Parameter(d, requires_grad=p.requires_grad)
                            if p.requires_grad:  # a frozen one has no gradient to synchronise
                                d.register_post_accumulate_grad_hook(_sync_grad)
                        done[id(p)] = d
                    table[key] = done[id(p)]
            if isinstance(mod, nn.RNNBase):
                mod._init_flat_weights()  # it caches its weights

    def _fetch(self, target: str) -> Any:
        obj: Any = self._gm[0]
        for part in target.split("."):
            obj = getattr(obj, part)
        return obj

    # -- running the graph
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        gm = self._gm[0]
        with autocast(self._rt.precision, self._rt.device_type):
            out = self._run(*cast_inputs(flat_inputs(gm, args, kwargs), self._rt.precision))
        spec = getattr(gm, "_out_spec", None)  # an exported model: its output's structure
        return tree_unflatten(list(out) if isinstance(out, (tuple, list)) else [out], spec) if spec else out

    def _run(self, *args: Any) -> Any:
        """The graph on its placeholders' values (:func:`flexsearch.graph.lift.flat_inputs`);
        each value is dropped after its last reader (:func:`last_uses`)."""
        gm = self._gm[0]
        env: dict[fx.Node, Any] = {}
        inputs = iter(args)
        ran: set[fx.Node] = set()  # the nodes of checkpointed runs, run with their first
        if self._runs:  # a weight fetched inside a unit is its input: fetched first
            for n in gm.graph.nodes:
                if n.op == "get_attr":
                    env[n] = self._fetch(n.target)
                    ran.add(n)
        for n in gm.graph.nodes:
            if n in ran:
                continue
            if n.op == "placeholder":
                env[n] = next(inputs)
            elif n.op == "get_attr":
                env[n] = self._fetch(n.target)
            elif n.op == "output":
                return tree_map(self._gather_output, fx.node.map_arg(n.args[0], lambda a: env[a]))
            elif n in self._runs:
                run, ins, outs = self._runs[n]
                env.update(zip(outs, run_checkpointed(functools.partial(self._unit, run, ins, outs), self._recompute,
                                                      *(env[a] for a in ins), whole=True), strict=True))
                ran.update(run)
                for m in run:
                    for done in self._last_uses.get(m, ()):
                        env.pop(done, None)
                continue
            else:
                env[n] = self._value(n, env)
            for done in self._last_uses.get(n, ()):  # what autograd does not save is freed now
                del env[done]
        raise EmitError("the model's graph has no output")

    def _value(self, n: fx.Node, env: dict[fx.Node, Any]) -> Any:
        """Op ``n``'s output: as planned, or plainly for a node the plan does not place."""
        if (node := self._graph.by_name.get(n.name)) is None or is_source(node):
            a, kw = fx.node.map_arg((n.args, n.kwargs), lambda a: env[a])
            return self._call(n, a, kw, None, None)
        return self._planned(n, node, env)

    def _unit(self, run: list[fx.Node], ins: list[fx.Node], outs: list[fx.Node], *values: Any) -> tuple:
        """A checkpointed unit's run of ops on its inputs' ``values``: its outputs."""
        env = dict(zip(ins, values, strict=True))
        for n in run:
            env[n] = self._value(n, env)
            for done in self._last_uses.get(n, ()):
                if done not in outs:
                    env.pop(done, None)
        return tuple(env[o] for o in outs)

    def _planned(self, n: fx.Node, node: OpNode, env: dict[fx.Node, Any]) -> Any:
        """Op ``n`` on its configuration's mesh, its inputs brought to their placements."""
        rt = self._rt
        c = self._configs.get(n.name, Config())
        mesh = self._mesh(c)

        def convert(a: fx.Node) -> Any:
            v = env[a]
            if not isinstance(v, torch.Tensor):
                return v
            if a.op == "call_function" and a.target is dense_input:  # a pipeline stage's received input
                a = a.args[0]
            k = node.inputs.index(a.name) if a.name in node.inputs else -1
            if k >= 0:
                pl = input_placements(node, k, tuple(v.shape), c)
            elif a.op == "get_attr" and a in n.args:  # an exported graph's weight
                pl = arg_placement(n, n.args.index(a), c)
            else:
                pl = REPLICATE
            return to_layout(rt, v, mesh, pl)

        done = write_in_place(n, env, node.opaque, lambda v, m, pl: to_layout(rt, v, m, pl),
                              lambda a, kw: _plain_call(self._gm[0], n, a, kw, {}), rt.rank)
        if done is not AS_PLANNED:
            return done
        try:
            a, kw = fx.node.map_arg((n.args, n.kwargs), convert)
            out = tree_map(dense_grad, self._call(n, a, kw, c, mesh))
            return tree_map(whole_grad, out) if c.kind == "x" and c.t > 1 else out
        except Exception as e:
            e.add_note(f"flexsearch: while running op {n.name} as {c.text} on rank {rt.rank}")
            raise

    def _call(self, n: fx.Node, args, kwargs, c: Config | None, mesh) -> Any:
        if c is None:
            return _plain_call(self._gm[0], n, args, kwargs, {})
        node = self._graph.by_name[n.name]
        mod = self._gm[0].get_submodule(n.target) if n.op == "call_module" else None
        if isinstance(mod, nn.Embedding) and c.kind == "r" and c.t > 1:
            return self._vocab_parallel(n, mod, args, c, mesh)
        if node.kind == "loss" and c.kind == "r" and c.t > 1:  # split by the samples: an exact mean
            call = loss_call(n.target, mod, args, kwargs)
            if mesh.get_coordinate() is None:  # not in the block: a number in the backward pass (a 0-dim
                # local tensor: from_local reads an empty shape as none given)
                return DTensor.from_local(Anchor.apply(call.input), mesh, REPLICATE, run_check=False)
            return loss_by_samples(call, mesh)
        if node.kind in _LOCAL_KINDS or node.opaque or isinstance(mod, _LOCAL_MODULES) or \
                (node.kind == "attention" and (c.n == 1 or mod is None and _per_head(args, kwargs))):
            return self._call_local(n, node, mod, args, kwargs, c, mesh)
        state = {}
        if mod is not None:
            for pname, p in _state(mod):
                want = param_placement(mod, pname, c)
                if isinstance(p, DTensor) and (p.device_mesh != mesh or p.placements != want):
                    state[pname] = to_layout(self._rt, p, mesh, want)
        with sdpa_kernel([SDPBackend.MATH]) if node.kind == "attention" else contextlib.nullcontext(), \
                implicit_replication():
            return _plain_call(self._gm[0], n, args, kwargs, state)

    def _vocab_parallel(self, n: fx.Node, mod: nn.Embedding, args, c: Config, mesh) -> DTensor:
        """An Embedding split by vocabulary (Megatron's vocab-parallel embedding): each of
        the ``t`` ranks looks up the ids in its rows and zeros the rest; the output is the
        ``Partial`` sum over ``t``."""
        if mod.padding_idx is not None or mod.max_norm is not None or mod.sparse:
            raise EmitError(f"{n.name}: a vocabulary split of an Embedding with padding_idx, max_norm or "
                            "sparse gradients is not supported; plan again")
        ids = args[0]
        s_pl = Shard(0) if c.s > 1 else Replicate()
        idx = to_layout(self._rt, ids, mesh, (s_pl, Replicate()))
        w = to_layout(self._rt, mod.weight, mesh, (Replicate(), Shard(0)))
        out_shape = (*ids.shape, mod.embedding_dim)
        out_pl = (s_pl, Partial())
        if mesh.get_coordinate() is None:
            anchor = Anchor.apply(w) if w.requires_grad else torch.zeros(())
            e = torch.empty(0, dtype=w.dtype, device=anchor.device) + anchor.to(w.dtype)
            return DTensor.from_local(e, mesh, out_pl, run_check=False, shape=torch.Size(out_shape),
                                      stride=dense_stride(out_shape))
        rows = mod.num_embeddings // c.t
        lo = mesh.get_local_rank("t") * rows
        li = idx.to_local()
        wl = w.to_local(grad_placements=(Partial() if c.s > 1 else Replicate(), Shard(0)))
        outside = (li < lo) | (li >= lo + rows)
        local = torch.nn.functional.embedding(torch.where(outside, 0, li - lo), wl)
        local = local.masked_fill(outside.unsqueeze(-1), 0.0)
        return DTensor.from_local(local, mesh, out_pl, run_check=False, shape=torch.Size(out_shape),
                                  stride=dense_stride(out_shape))

    def _call_local(self, n: fx.Node, node: OpNode, mod: nn.Module | None, args, kwargs, c: Config, mesh) -> Any:
        """Run an op on local tensors with explicit placements (``local_map``'s contract),
        for ops DTensor has no rule for (RNNs, opaque ops) or runs wrongly (convolutions
        with split channels). Convolutions and RNN layers keep their sample split (and a
        conv its output-channel split); ``scaled_dot_product_attention`` its sample and
        heads splits (without dropout or grouped keys and values: :func:`_per_head`;
        each rank's heads with the kernel the model runs: DTensor has no
        rule for the CPU's fused kernel, and the math backend it falls back to keeps the
        fp32 probabilities); anything else is gathered and computed whole on every rank
        of its mesh. Ranks outside the mesh compute nothing; their empty outputs still
        depend on the inputs, so the backward pass reaches every transfer a rank takes
        part in."""
        rt = self._rt
        member = mesh.get_coordinate() is not None
        split = isinstance(mod, _LOCAL_MODULES)
        heads = node.kind == "attention" and mod is None
        anchors: list[torch.Tensor] = []
        t_grad = Partial() if split and c.kind == "p" else Replicate()
        # attention: each input as the plan placed it (input_placements); an input a
        # split dim broadcasts over (a mask) gets a partial gradient on that dim
        work = (c.s > 1, c.kind == "a" and c.t > 1)

        def local(v: torch.Tensor, pl: tuple, grad_pl: tuple) -> torch.Tensor:
            r = to_layout(rt, v, mesh, pl)
            if member:
                return r.to_local(grad_placements=grad_pl) if isinstance(r, DTensor) else r
            if r.requires_grad:
                anchors.append(Anchor.apply(r))
            return torch.empty(v.shape, dtype=v.dtype, device="meta")

        def meta(v: torch.Tensor) -> torch.Tensor:
            """A meta stand-in for shapes only: floating point in fp32, since autocast (which
            makes a mixed-precision op's dtypes agree) does not run on the meta device; the
            outputs' dtypes are the graph's (traced under the plan's precision)."""
            return torch.empty(v.shape, dtype=torch.float32 if v.is_floating_point() else v.dtype, device="meta")

        flat, spec = tree_flatten((args, kwargs))
        tensors = [i for i, v in enumerate(flat) if isinstance(v, torch.Tensor)]
        lflat = list(flat)
        mflat = [torch.device("meta") if isinstance(v, torch.device) else v for v in flat]  # `to(device=cpu)`
        for j, i in enumerate(tensors):
            v = flat[i]
            mflat[i] = meta(v)
            if heads:
                pl = v.placements if isinstance(v, DTensor) else REPLICATE
                lflat[i] = local(v, pl, tuple(Partial() if w and isinstance(q, Replicate) else q
                                              for q, w in zip(pl, work, strict=True)))
                continue
            s_pl = Shard(_split_dim(mod, j)) if split and c.s > 1 else Replicate()
            lflat[i] = local(v, (s_pl, Replicate()), (s_pl, t_grad))
        lstate, mstate = {}, {}
        for pname, p in _state(mod) if mod is not None else ():
            pl = param_placement(mod, pname, c) if split else REPLICATE
            grad_pl = ((Partial() if c.s > 1 else Replicate()), pl[1]) if split else REPLICATE
            lstate[pname] = local(p, pl, grad_pl if p.requires_grad else pl)
            mstate[pname] = meta(p)
        key = (n.name, *((tuple(v.shape), v.dtype) for v in mflat if isinstance(v, torch.Tensor)))
        shapes = self._shapes.get(key)
        if shapes is None:
            with torch.no_grad():
                shapes = self._shapes[key] = _plain_call(self._gm[0], n, *tree_unflatten(mflat, spec), mstate)
        mout, mspec = tree_flatten(shapes)
        dtypes = [getattr(torch, m.dtype) for m in node.outputs]
        mout = [t.to(dtypes[k]) if isinstance(t, torch.Tensor) and k < len(dtypes) else t
                for k, t in enumerate(mout)]
        places = [(Shard(_split_dim(mod, j)) if split and c.s > 1 else Replicate(),
                   Shard(1) if split and c.kind == "p" else Replicate()) for j in range(len(mout))]
        if heads:  # (batch, heads, queries, values): the sample and heads splits kept
            places = [(Shard(batch_dim(node)) if work[0] else Replicate(), Shard(c.dim) if work[1] else Replicate())
                      for _ in mout]
        if member:
            out = tree_flatten(_plain_call(self._gm[0], n, *tree_unflatten(lflat, spec), lstate))[0]
            wrapped = [DTensor.from_local(t, mesh, pl, run_check=False, shape=g.shape, stride=g.stride())
                       if isinstance(t, torch.Tensor) else t for t, g, pl in zip(out, mout, places, strict=True)]
            return tree_unflatten(wrapped, mspec)
        anchor = sum(anchors, torch.zeros((), device=meta_device(args)))

        def empty(t: Any, pl: tuple) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            e = torch.empty(0, dtype=t.dtype, device=anchor.device)
            if t.dtype.is_floating_point:
                e = e + anchor.to(t.dtype)
            return DTensor.from_local(e, mesh, pl, run_check=False, shape=t.shape, stride=t.stride())

        return tree_unflatten([empty(t, pl) for t, pl in zip(mout, places, strict=True)], mspec)

    def named_original_parameters(self):
        """Parameters (DTensors) under their names in the original model."""
        return self.module.named_parameters()

    def train_step(self, inputs: tuple, target: Any = None, loss_fn=None) -> torch.Tensor:
        """Forward and backward of the global batch (the same on every rank; a trailing
        dict of keyword inputs); the loss (``loss_fn`` None: the model's own)."""
        args, kwargs = split(inputs)
        out = self(*args, **kwargs)
        with autocast(self._rt.precision, self._rt.device_type):
            loss = step_loss(out, target, loss_fn)
        backward(loss, self._rt.precision, self.parameters)
        return loss.detach().float()

    def _gather_output(self, v: Any) -> Any:
        if isinstance(v, DTensor):
            return Whole.apply(to_layout(self._rt, v, self._world, REPLICATE))
        return v


_LOCAL_KINDS = frozenset({"rnn", "opaque"})


"""Op kinds run on local tensors (DTensor has no sharding rule for them). Attention
(``scaled_dot_product_attention``, and ``nn.MultiheadAttention`` on one device) also runs
locally: with the kernel the original model runs (the profiled one; on DTensors it runs
the math backend, ``torch.profiler``: 2.4 ms against 1.0 ms per call on the GPT of
``benchmarks/fidelity.py``)."""
_LOCAL_MODULES = (nn.modules.conv._ConvNd, nn.RNNBase)
"""Layers run on local shards with their sample (and channel) split kept."""


_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def _per_head(args: tuple, kwargs: Mapping[str, Any]) -> bool:
    """Can ``scaled_dot_product_attention`` run on each rank's heads alone? Not with
    dropout (each rank would draw its own mask, where DTensor's RNG tracker keeps a
    replicated output's agree) nor with grouped keys and values (``enable_gqa``: a
    rank's query heads would meet the wrong ones); those run on DTensors."""
    named = {**dict(zip(_SDPA_ARGS, args, strict=False)), **kwargs}
    return not named.get("dropout_p") and not named.get("enable_gqa")


def _state(mod: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return list(mod.named_parameters(recurse=True)) + list(mod.named_buffers(recurse=True))


def _split_dim(mod: nn.Module | None, j: int) -> int:
    """The batch dim of the ``j``-th tensor input or output of a sample-split layer:
    dim 0 for a convolution; for an RNN its sequence tensor's batch dim, then dim 1 of
    the (layers, batch, hidden) states."""
    if isinstance(mod, nn.RNNBase):
        return (0 if mod.batch_first else 1) if j == 0 else 1
    return 0


def meta_device(tree: Any) -> torch.device:
    """The device of the first tensor in ``tree`` (CPU when there is none)."""
    for leaf in tree_flatten(tree)[0]:
        if isinstance(leaf, torch.Tensor):
            return leaf.to_local().device if isinstance(leaf, DTensor) else leaf.device
    return torch.device("cpu")


def _plain_call(gm: fx.GraphModule, n: fx.Node, args, kwargs, state: Mapping[str, Any]) -> Any:
    if n.op == "call_function":
        return n.target(*args, **kwargs)
    if n.op == "call_method":
        # a view's backward views the incoming gradient, which DTensor's sharding rules
        # may leave non-contiguous; reshape is the same op forward and safe backward
        target = "reshape" if n.target == "view" and isinstance(args[0], DTensor) else n.target
        return getattr(args[0], target)(*args[1:], **kwargs)
    mod = gm.get_submodule(n.target)
    if not state:
        return mod(*args, **kwargs)
    return torch.func.functional_call(mod, dict(state), args, kwargs, tie_weights=False, strict=False)


def _sync_grad(p: torch.Tensor) -> None:
    """After accumulation: the gradient takes its parameter's placements (a Partial
    gradient of a replicated parameter is all-reduced over the ranks that hold it)."""
    g = p.grad
    if isinstance(g, DTensor) and isinstance(p, DTensor) and g.placements != p.placements:
        p.grad = g.redistribute(p.device_mesh, p.placements)


def shard(model: nn.Module, gm_of, graph: OpGraph, configs: Mapping[str, Config], rt: Runtime,
          recompute: str = "none") -> ShardedModule:
    """A :class:`ShardedModule` running ``configs`` (every node of ``graph``) on a copy of
    ``model`` with activation checkpointing ``recompute``; ``gm_of(copy)`` lifts the copy
    into its FX graph module."""
    m = cast_model(copy.deepcopy(model), rt.precision)
    return ShardedModule(m, gm_of(m), graph, configs, rt, recompute=recompute)
