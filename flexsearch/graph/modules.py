"""Facts about a model's module tree that sharding rules need, read from the model.

:func:`module_facts` lists the model's top-level modules that hold parameters and,
for plain containers (``nn.ModuleList``, ``nn.ModuleDict``), their items, recursively,
in module order: each with its path, whether it is a container, and the canonical
names of the parameters under it (by identity, so a weight tied between two modules
has the same name in both). The tracer records them in the graph
(:attr:`~flexsearch.graph.opgraph.OpGraph.modules`); the emitter reads the same facts
from the model it wraps, so both sides apply one rule
(:func:`flexsearch.strategy.fsdp.fsdp_units`) to one set of facts.
"""

from __future__ import annotations

from torch import nn
from torch.nn.utils import parametrize

from flexsearch.graph.opgraph import ModuleFacts

CONTAINERS = (nn.ModuleList, nn.ModuleDict)


def module_facts(model: nn.Module) -> tuple[ModuleFacts, ...]:
    """The model's sharding-relevant modules (module docstring)."""
    canon: dict[int, str] = {}
    for name, p in model.named_parameters():
        canon.setdefault(id(p), name)
    out: list[ModuleFacts] = []

    def visit(module: nn.Module, prefix: str) -> None:
        item = isinstance(module, CONTAINERS)  # a container's items are units, whatever they hold
        for name, child in module.named_children():
            path = f"{prefix}{name}"
            params = tuple(dict.fromkeys(canon[id(p)] for _, p in child.named_parameters(remove_duplicate=False)
                                         if id(p) in canon))
            if not params:
                continue
            container = isinstance(child, CONTAINERS) or (not item and _holds_container(child))
            out.append(ModuleFacts(path=path, container=container, params=params))
            if container:
                visit(child, path + ".")

    visit(model, "")
    return tuple(out)


def _holds_container(module: nn.Module) -> bool:
    """Does a container with parameters sit anywhere below ``module`` (a Hugging Face
    ``LlamaModel`` around its ``layers``)? Such a module, unless a container's item (a
    T5 block around its sublayers stays one unit), is looked into like a container: its
    children, and the container's items, are the units, not the whole stack."""
    return any(isinstance(m, CONTAINERS) and any(True for _ in m.parameters())
               for m in module.modules() if m is not module)


def parametrized(module: nn.Module) -> bool:
    """Is a weight of ``module`` (or of a module inside it) computed from parameters at
    each call (a parametrization: ``weight_norm``)?"""
    return any(parametrize.is_parametrized(m) for m in module.modules())
