"""Where a model couples the samples of its batch: what data-parallel training changes.

Data-parallel plans (DDP, ZeRO, FSDP2), D-PSGD, pipelines and gradient accumulation
run the model on a share of the batch (a replica's samples, a microbatch) and average
the gradients. That is the gradient of the whole batch's loss while every op computes a
sample's outputs from that sample alone and the samples meet only in sums or means
that reach the loss linearly (a mean loss, a sum of mean losses, scaled). Two patterns
break it; :func:`sample_coupling` finds them where the ops' dim maps and kinds show them:

- **mixing**: an op whose output for one sample reads other samples of an input, such
  as CLIP's image-text logits ``img @ txt.T`` (each image against every text of the
  batch) or a contrastive loss's similarity matrix. Found from the op's dim map
  (:func:`flexsearch.graph.regions.dim_map`): no output dim, or one other than the
  output's batch dim, indexes the input's batch dim;
- **nonlinear**: a value reduced over the samples (a batch mean) that is multiplied by
  another, divides something, goes through a nonlinear op or is applied back to each
  sample before the loss, such as a mixture-of-experts load-balancing loss (the
  fraction of tokens per expert times the mean router probability, each over the
  batch) or ``x - x.mean(0)``.

Each node's batch dim is its SOAP sample dim; an opaque op's (no dims) follows its
inputs' as :func:`flexsearch.graph.registry._follow_batch` does; the model's inputs
carry it in dim 0, as the tracer takes it. A value is batch-wide when a sum or mean
over the samples made it, or an opaque op that drops the batch dim of a floating-point
input (``histc``, counting tokens per expert); the latter counts only in a product with
the former (a mixture-of-experts dispatch counts tokens per expert to group them, which
couples nothing). Where nothing tells (an op with SOAP
dims that drops the batch dim other than by a sum, an integer or boolean aggregate),
nothing is inferred and nothing reported: the check names only what it can show.
Known gaps, not reported: a softmax, norm or elementwise op over the batch dim
(``x.softmax(0)``, ``F.normalize(x, dim=0)``: their dim maps are right-aligned, as for
any op of one shape); views and indexing that move samples (mixup's
``x[torch.randperm(B)]``, ``x.roll(1, 0)``); a division by a batch-wide value (the
graph does not say which argument a lone tensor input of a division is, and
``loss / k`` is the common case). BatchNorm's batch statistics are the plan's own setting
(``batch_norm``) and are not reported here.
"""

from __future__ import annotations

from dataclasses import dataclass

from flexsearch.graph.microbatch import batch_dim, batch_size
from flexsearch.graph.opgraph import OpGraph, OpNode
from flexsearch.graph.regions import dim_map

_MAPPED = frozenset({"linear", "matmul", "conv", "pool", "embedding", "attention", "elementwise", "activation",
                     "dropout", "norm", "softmax"})
"""Kinds whose dim map says which input samples an output sample reads (others are not
checked for mixing; a view only moves the batch dim, which the tracer follows, where
shapes alone cannot tell a square transpose from the identity)."""
_PASSING = frozenset({"add", "sub", "rsub", "neg", "float", "to", "_to_copy", "type", "type_as", "half", "bfloat16",
                      "double", "clone", "contiguous", "detach", "alias", "squeeze", "unsqueeze", "view", "reshape",
                      "_unsafe_view", "lift_fresh_copy", "sum", "mean"})
"""Ops linear in a batch-wide value (an op name's part): a sum of losses, a cast."""
_SCALING = frozenset({"mul", "truediv", "div"})
"""Ops linear in one batch-wide operand (the first, for a division)."""


@dataclass(frozen=True)
class Coupling:
    """One op that couples samples: its name, where the model's source has it, and how
    (``mixing`` or ``nonlinear``, module docstring) in words."""

    node: str
    source: str
    how: str
    why: str

    @property
    def text(self) -> str:
        where = f" ({self.source.rsplit('/', 1)[-1]})" if self.source else ""
        return f"`{self.node}`{where} {self.why}"


_IN_PLACE = {"iadd": "add", "isub": "sub", "imul": "mul", "itruediv": "truediv"}
"""Python's augmented assignments (``loss += ...``), as fx records them."""


def _op_parts(node: OpNode) -> set[str]:
    """The parts of the node's target, an in-place op's as its out-of-place one's
    (``add_``, ``operator.iadd``: ``add``)."""
    parts = set()
    for p in node.target.replace("::", ".").split("."):
        p = _IN_PLACE.get(p, p)
        parts.add(p.rstrip("_") if p.endswith("_") and not p.startswith("_") else p)
    return parts


def _batch_dims(graph: OpGraph) -> dict[str, int | None]:
    """Each node's batch dim (module docstring), None where it has none or none is known."""
    try:
        batch = batch_size(graph)
    except ValueError:
        return {}
    out: dict[str, int | None] = {}
    for n in graph.nodes:
        shape = n.outputs[0].shape if n.outputs else ()
        if n.kind == "input":
            out[n.name] = 0 if shape and shape[0] == batch else None
            continue
        d = batch_dim(n)
        if d is None and not n.dims.output and not n.dims.reduced:  # opaque: follow an input's
            for p in n.inputs:
                b, src = out.get(p), graph.node(p)
                if b is None or not src.outputs:
                    continue
                ins = src.outputs[0].shape
                if len(shape) > b and shape[b] == ins[b]:
                    d = b
                elif 0 <= (moved := b + len(shape) - len(ins)) < len(shape) and shape[moved] == ins[b]:
                    d = moved
                if d is not None:
                    break
        out[n.name] = d
    return out


def sample_coupling(graph: OpGraph) -> tuple[Coupling, ...]:
    """The ops of ``graph`` that couple the samples of its batch (module docstring), in
    graph order: each the first of its chain, not the ops that read its result."""
    dims = _batch_dims(graph)
    if not dims:
        return ()
    # "sample": per sample; "reduced": a sum or mean over the samples; "aggregate": an
    # opaque op's over them (reported only with a reduced one: a mixture-of-experts
    # dispatch counts tokens per expert to group them, which couples nothing);
    # "coupled": after an op found (what follows it is not reported again)
    status: dict[str, str] = {}
    found: list[Coupling] = []
    for n in graph.nodes:
        if n.kind == "input":
            if dims.get(n.name) is not None:
                status[n.name] = "sample"
            continue
        ins = [status.get(p) for p in n.inputs]
        if "coupled" in ins:
            status[n.name] = "coupled"
            continue
        sample = [k for k, s in enumerate(ins) if s == "sample"]
        reduced = [k for k, s in enumerate(ins) if s == "reduced"]
        wide = len(reduced) + sum(s == "aggregate" for s in ins)
        d = dims.get(n.name)
        if reduced and n.kind != "output":
            parts = _op_parts(n)
            linear = (n.kind == "view" or parts & _PASSING
                      or (parts & _SCALING and wide == 1 and not sample
                          and (reduced[0] == 0 or not parts & {"truediv", "div"})))
            if sample or not linear:
                why = ("applies a value reduced over the batch to each sample" if sample else
                       "takes a value reduced over the batch nonlinearly"
                       + (" (a product of two)" if wide > 1 else ""))
                found.append(Coupling(n.name, n.source, "nonlinear", why))
                status[n.name] = "coupled"
                continue
            status[n.name] = "reduced"
            continue
        if not sample:
            if wide:
                status[n.name] = "aggregate"
            continue
        if d is None:
            if n.dims.over_samples:  # a sum or mean over the samples
                status[n.name] = "reduced"
            elif not n.dims.output and not n.dims.reduced and n.outputs \
                    and n.outputs[0].dtype.startswith(("float", "bfloat")):
                status[n.name] = "aggregate"
            continue
        status[n.name] = "sample"
        if n.kind not in _MAPPED:
            continue
        for k in sample:
            p = graph.node(n.inputs[k])
            b = dims[p.name]
            links = dim_map(n, k, p.outputs[0].shape)
            link = links[d] if d < len(links) else None
            if b is not None and (link is None or link[0] != b):
                found.append(Coupling(n.name, n.source, "mixing",
                                      f"reads every sample of its input `{p.name}` for each sample it computes"))
                status[n.name] = "coupled"
                break
    return tuple(found)


def coupling_note(found: tuple[Coupling, ...], kind: str) -> str | None:
    """The plan note for a ``kind`` plan that splits the batch over replicas or
    microbatches (None when nothing couples the samples)."""
    if not found:
        return None
    ops = "; ".join(c.text for c in found[:3]) + (f"; and {len(found) - 3} more" if len(found) > 3 else "")
    return (f"the model couples the samples of its batch: {ops}. This {kind} plan computes that over each "
            "replica's (and microbatch's) samples, as DDP would, so its loss and gradients differ from the "
            "model's over the whole batch (`flexsearch verify` shows by how much); a SOAP plan (--kind soap) "
            "computes it over the whole batch, or gather the samples in the model (all_gather with "
            "gradients, as open_clip's loss does)")
